"""A labelled set of pluses for ``span-workflows lint``: which commute, which do not.

Every case is a small query around one labelled plus (at ``input.cross[1]`` unless the case
says otherwise), written to read like what users send:

* **commuting** (the label ``commutes=True``): retrieved documents, independent drafts,
  parallel tool results of one turn. Some hold the words a careless lint would trip on: "the
  first arch bridge", "the previous record", "in step 3 of the setup", lists that each start
  at 1, a "Chapter 12" heading, a source line without a full stop.
* **order-dependent**: numbered steps, a story split in parts, the turns of a dialogue, a
  table split across chunks, tool results of different turns. Some carry no word that gives
  them away (steps without numbers, a story told in plain sentences, a chat without speaker
  labels): only the order check can find those.

A small *held-out* group (``labelled_set(held_out=True)``, ``LabelledPlus.held_out``) was
written after the rules and the verdict's thresholds were fixed on the main set: its rates
say how the rules fare on text they were not made on.

The benchmark (``span-workflows bench lint``) runs the static checks and the order check on
every case; the tests run the static checks on all and the order check on a few.
"""

from __future__ import annotations

from dataclasses import dataclass

from span_workflows.query.builders import assistant, fragment, g, system, user
from span_workflows.query.ir import Cross, Node, Plus
from span_workflows.query.sampling import render_calls, render_tool_result

RAG_SYSTEM = "Answer the question using only the texts. Be brief."
STEPS_SYSTEM = "Answer the question about the instructions. Be brief."
STORY_SYSTEM = "Answer the question about the story. Be brief."
JUDGE_SYSTEM = "You compare drafts. Be brief."
AGENT_SYSTEM = "You are an assistant that uses tools. Answer from the tool results."

#: The kinds of case, commuting ones first.
COMMUTING_KINDS = ("retrieved documents", "independent drafts", "parallel tool results")
ORDERED_KINDS = ("numbered steps", "story in parts", "dialogue turns", "table in chunks",
                 "agent turns")


@dataclass(frozen=True, slots=True)
class LabelledPlus:
    """One case: ``query`` holds the plus at ``path``; ``commutes`` is its label."""

    name: str
    kind: str
    commutes: bool
    query: Node
    path: str = "input.cross[1]"
    #: written after the rules and thresholds were fixed (a check of how they generalize)
    held_out: bool = False


def _qa(system_text: str, texts: list[str], question: str, *, as_drafts: bool = False) -> Node:
    items = [assistant(t) if as_drafts else fragment(t) for t in texts]
    return g([system(system_text), Plus(tuple(items)), user(question)], max_tokens=24,
             temperature=0.0)


def _tools(question: str, calls: list[tuple[str, dict]], results: list[tuple[str, str]],
           earlier: list[list[tuple[str, dict]]] = ()) -> Node:
    """An agent turn: the question, the earlier turns' calls (their results left out), the
    last turn's calls, then the tool results in one plus."""
    turns = [assistant(render_calls(c)) for c in earlier]
    parts = [system(AGENT_SYSTEM), user(question), *turns, assistant(render_calls(calls)),
             Plus(tuple(user(render_tool_result(n, t)) for n, t in results)),
             user("Answer the question in one sentence.")]
    return g(Cross(tuple(parts)), max_tokens=24, temperature=0.0)


def _path(query: Node) -> str:
    """The path of the only plus directly in the root G's cross."""
    kids = query.input.children  # type: ignore[union-attr]
    return f"input.cross[{next(i for i, k in enumerate(kids) if isinstance(k, Plus))}]"


def _commuting() -> list[LabelledPlus]:
    r, d, t = COMMUTING_KINDS
    cases = [
        LabelledPlus("bridges", r, True, _qa(RAG_SYSTEM, [
            "The Iron Bridge over the River Severn was the first arch bridge made of cast "
            "iron. It opened in 1781.",
            "Pont de Normandie, a cable-stayed bridge across the Seine, opened to traffic in "
            "1995.",
            "The Brooklyn Bridge, finished in 1883, joins Manhattan and Brooklyn.",
        ], "Which bridge opened in 1995?")),
        LabelledPlus("lighthouse", r, True, _qa(RAG_SYSTEM, [
            "The Gull Rock lighthouse was built in 1871 and is painted red and white.",
            "Keeper Ada Lind kept the Gull Rock light burning for forty-two winters.",
            "The Gull Rock foghorn sounds twice every thirty seconds in thick weather.",
        ], "Who kept the Gull Rock light?")),
        LabelledPlus("router manuals", r, True, _qa(RAG_SYSTEM, [
            "Resetting the Falcon router:\n1. Hold the reset button for ten seconds.\n"
            "2. Wait for the light to blink green.",
            "Updating the Falcon firmware:\n1. Download the file from the support page.\n"
            "2. Upload it under Settings, then Firmware.",
            "The Falcon router has four Ethernet ports and one USB port.",
        ], "How long do you hold the reset button?")),
        LabelledPlus("records", r, True, _qa(RAG_SYSTEM, [
            "Mina Ortiz broke the previous record for the 800 m by two seconds in 2019.",
            "The next solar eclipse visible from Lisbon will happen in August 2026.",
            "The stadium in Valdora seats forty thousand people.",
        ], "When is the next solar eclipse visible from Lisbon?")),
        LabelledPlus("first avenue", r, True, _qa(RAG_SYSTEM, [
            "First Avenue Bridge in Tarn opened in 1820 and carries only cyclists today.",
            "The Tarn river freezes over in most winters since the dam was removed.",
            "The old mill of Tarn was turned into a museum of printing.",
        ], "When did First Avenue Bridge open?")),
        LabelledPlus("tide tables", r, True, _qa(RAG_SYSTEM, [
            "Tide tables for Port Elwin are published every March by the harbour office.\n"
            "Source: Port Elwin Gazette",
            "High tide at Port Elwin comes about forty minutes later than at Carrow Point.",
            "The harbour office of Port Elwin is open on weekdays from nine to five.",
        ], "Who publishes the tide tables for Port Elwin?")),
        LabelledPlus("telescope summaries", r, True, _qa(RAG_SYSTEM, [
            "Summary: The Vela telescope found water ice on the moon Rhea in 2021.",
            "Summary: Rhea is the second largest moon of Saturn.",
            "Summary: The Vela telescope sits on a mountain in Chile at 4,600 metres.",
        ], "What did the Vela telescope find?")),
        LabelledPlus("town history", r, True, _qa(RAG_SYSTEM, [
            "Chapter 12 of the Harwick town history tells how the railway reached Harwick in "
            "1862.",
            "The market of Harwick is held every Thursday on the square by the church.",
            "The Harwick brass band was founded by miners in 1904.",
        ], "When did the railway reach Harwick?")),
        LabelledPlus("kettle reviews", r, True, _qa(RAG_SYSTEM, [
            "Review of the Orla kettle: it boils a litre in three minutes and the handle "
            "stays cool.",
            "Review of the Orla kettle: the lid is stiff, but the kettle is very quiet.",
            "Review of the Orla kettle: after a year of daily use it still works perfectly.",
        ], "How fast does the Orla kettle boil a litre?")),
        LabelledPlus("tent", r, True, _qa(RAG_SYSTEM, [
            "In step 3 of the Kestrel tent setup, the poles are clipped to the inner tent.",
            "The Kestrel tent weighs 1.9 kilograms and sleeps two people.",
            "Kestrel tents come with a five-year warranty on the seams.",
        ], "How much does the Kestrel tent weigh?")),
        LabelledPlus("bakery slogans", d, True, _qa(JUDGE_SYSTEM, [
            "Fresh bread every morning, baked with love.",
            "Wake up to the smell of warm bread.",
            "Good bread, good day.",
        ], "Do all three slogans talk about bread? Answer yes or no.", as_drafts=True)),
        LabelledPlus("harbour at dusk", d, True, _qa(JUDGE_SYSTEM, [
            "The sunset painted the harbour orange while the boats came home.",
            "Orange light spread over the water as the fishermen returned.",
            "The harbour glowed orange at dusk and the boats were tied up.",
        ], "Which colour do all three drafts mention? Answer with one word.",
            as_drafts=True)),
        LabelledPlus("subject lines", d, True, _qa(JUDGE_SYSTEM, [
            "Your order has shipped",
            "Good news: your parcel is on its way",
            "Shipped! Track your order today",
        ], "What are all three subject lines about? Answer in a few words.",
            as_drafts=True)),
        LabelledPlus("translations", d, True, _qa(JUDGE_SYSTEM, [
            "The cat sleeps on the warm windowsill.",
            "On the warm windowsill, the cat is sleeping.",
            "The cat is asleep on the sunny windowsill.",
        ], "Where is the cat in these translations?", as_drafts=True)),
        LabelledPlus("vitamin answers", d, True, _qa(JUDGE_SYSTEM, [
            "Oranges are rich in vitamin C.",
            "Kiwi fruit has even more vitamin C than oranges.",
            "Guavas contain a lot of vitamin C.",
        ], "Which vitamin do all the answers talk about?", as_drafts=True)),
        LabelledPlus("jacket blurbs", d, True, _qa(JUDGE_SYSTEM, [
            "A light rain jacket that folds into its own pocket.",
            "Stay dry on the trail with this packable rain jacket.",
            "This rain jacket weighs only 200 grams.",
        ], "What product do the drafts describe? Answer in three words.", as_drafts=True)),
        LabelledPlus("bike lane headlines", d, True, _qa(JUDGE_SYSTEM, [
            "City council approves new bike lanes",
            "New bike lanes get the green light from the council",
            "Council votes yes on bike lanes for the old town",
        ], "What did the council approve?", as_drafts=True)),
        LabelledPlus("weather", t, True, _tools(
            "What is the weather in Paris and in Rome?",
            [("weather", {"city": "Paris"}), ("weather", {"city": "Rome"})],
            [("weather", "Paris: 18 °C, cloudy."), ("weather", "Rome: 24 °C, sunny.")])),
        LabelledPlus("lyon population", t, True, _tools(
            "How many people live in Lyon, and what is twice that?",
            [("search", {"q": "population of Lyon"}), ("calculator", {"expr": "520000*2"})],
            [("search", "Lyon has about 520,000 inhabitants."), ("calculator", "1040000")])),
        LabelledPlus("stock prices", t, True, _tools(
            "Which of Apple, Microsoft and Nvidia has the highest share price?",
            [("get_price", {"ticker": "AAPL"}), ("get_price", {"ticker": "MSFT"}),
             ("get_price", {"ticker": "NVDA"})],
            [("get_price", "AAPL 189.20 USD"), ("get_price", "MSFT 415.50 USD"),
             ("get_price", "NVDA 121.40 USD")])),
        LabelledPlus("capitals", t, True, _tools(
            "What are the capitals of France and Peru?",
            [("lookup_capital", {"country": "France"}), ("lookup_capital", {"country": "Peru"})],
            [("lookup_capital", "Paris"), ("lookup_capital", "Lima")])),
        LabelledPlus("umbrella", t, True, _tools(
            "Do I need an umbrella for my dentist appointment?",
            [("calendar", {"query": "dentist"}), ("weather", {"city": "here", "day": "Friday"})],
            [("calendar", "Dentist at 10:00 on Friday."),
             ("weather", "Rain expected on Friday morning.")])),
        LabelledPlus("deep lakes", t, True, _tools(
            "How deep are Lake Baikal and Lake Tanganyika?",
            [("search", {"q": "Lake Baikal depth"}), ("search", {"q": "Lake Tanganyika depth"})],
            [("search", "\n1. Lake Baikal is the deepest lake on Earth, 1,642 m.\n"
                        "2. It holds a fifth of the fresh water on the surface."),
             ("search", "\n1. Lake Tanganyika is the second deepest lake, 1,470 m.\n"
                        "2. It lies in four countries.")])),
        LabelledPlus("two files", t, True, _tools(
            "What do the notes in a.txt and b.txt say?",
            [("read_file", {"path": "a.txt"}), ("read_file", {"path": "b.txt"})],
            [("read_file", "The team meeting moved to Tuesday."),
             ("read_file", "Bring the quarterly report to the meeting.")])),
    ]
    return [LabelledPlus(c.name, c.kind, c.commutes, c.query, _path(c.query)) for c in cases]


def _ordered() -> list[LabelledPlus]:
    s, st, dl, tb, ag = ORDERED_KINDS
    cases = [
        LabelledPlus("bread steps", s, False, _qa(STEPS_SYSTEM, [
            "Step 1: Preheat the oven to 200 °C.",
            "Step 2: Put the dough in a tin.",
            "Step 3: Bake for forty minutes.",
        ], "What is the last step?")),
        LabelledPlus("router steps", s, False, _qa(STEPS_SYSTEM, [
            "1. Unplug the router.",
            "2. Wait thirty seconds.",
            "3. Plug the router back in.",
        ], "What do you do right after unplugging the router?")),
        LabelledPlus("tea steps", s, False, _qa(STEPS_SYSTEM, [
            "First, pour water into the kettle.",
            "Then, switch the kettle on.",
            "Finally, pour the hot water over the tea.",
        ], "What is the final step?")),
        LabelledPlus("tree planting", s, False, _qa(STEPS_SYSTEM, [
            "To plant a tree:\n1. Dig a hole twice as wide as the roots.\n"
            "2. Set the tree in the hole.",
            "3. Fill the hole with soil.\n4. Water the tree well.",
        ], "What comes after setting the tree in the hole?")),
        LabelledPlus("cocoa", s, False, _qa(STEPS_SYSTEM, [
            "Pour the milk into a pan.",
            "Heat the milk until it steams.",
            "Stir in the cocoa and the sugar.",
        ], "What do you do last?")),
        LabelledPlus("filter parts", s, False, _qa(STEPS_SYSTEM, [
            "Part 1 of 3: Remove the old filter.",
            "Part 2 of 3: Rinse the filter housing.",
            "Part 3 of 3: Insert the new filter.",
        ], "What is done second?")),
        LabelledPlus("fox and crow", st, False, _qa(STORY_SYSTEM, [
            "Once upon a time a fox lived near the old",
            "mill by the river. One day he met a crow",
            "who held a piece of cheese in her beak.",
        ], "How does the story start?")),
        LabelledPlus("lena's map", st, False, _qa(STORY_SYSTEM, [
            "Chapter 1\nLena found a map in her grandmother's attic.",
            "Chapter 2\nThe map led her to a cave by the sea.",
            "Chapter 3\nIn the cave she found her grandmother's lost ring.",
        ], "What happens at the end of the story?")),
        LabelledPlus("sunflower", st, False, _qa(STORY_SYSTEM, [
            "Tom planted a seed in the garden.",
            "The next morning, a small green shoot appeared.",
            "Then it grew into a tall sunflower.",
        ], "What happened first?")),
        LabelledPlus("mara's key", st, False, _qa(STORY_SYSTEM, [
            "Mara found a key in the sand.",
            "She used it to open an old chest.",
            "Inside the chest was her grandfather's map.",
        ], "What did Mara do first?")),
        LabelledPlus("sailor", st, False, _qa(STORY_SYSTEM, [
            "The sailor reached the harbour at dusk and looked for his ship. (continued)",
            "(continued) The ship had already left, so he slept at the inn. (continued)",
            "(continued) At dawn he took the ferry to the next island.",
        ], "What did the sailor do first?")),
        LabelledPlus("mara's journey", st, False, _qa(STORY_SYSTEM, [
            "Mara packed her bag.",
            "Mara walked to the harbour.",
            "Mara boarded the night ship.",
        ], "What did Mara do last?")),
        LabelledPlus("table booking", dl, False, g([
            system("You are a restaurant assistant. Reply to the last message."),
            Plus((user("Can you book a table for two?"), assistant("Sure. For what time?"),
                  user("Eight tonight, please."))),
        ], max_tokens=24, temperature=0.0)),
        LabelledPlus("the cat bowl", dl, False, _qa(RAG_SYSTEM, [
            "Alice: Did you feed the cat?",
            "Bob: Yes, this morning.",
            "Alice: Then why is the bowl empty?",
        ], "Who spoke last, and what did they ask?")),
        LabelledPlus("order 4471", dl, False, _qa(RAG_SYSTEM, [
            "Customer: My order 4471 has not arrived.",
            "Agent: I am sorry. It left our warehouse on Monday.",
            "Customer: Can you send a new one?",
        ], "What does the customer ask for at the end?")),
        LabelledPlus("peru quiz", dl, False, _qa(RAG_SYSTEM, [
            "Q: What is the capital of Peru?",
            "A: Lima.",
        ], "What was the question, and what was the answer?")),
        LabelledPlus("gift for sister", dl, False, _qa(RAG_SYSTEM, [
            "I need a gift for my sister, who likes hiking.",
            "As I said, she likes hiking, so maybe a water bottle?",
            "Actually, the previous answer was better: a map of the Alps.",
        ], "Which gift was chosen in the end?")),
        LabelledPlus("shoe return", dl, False, _qa(RAG_SYSTEM, [
            "I want to return my shoes.",
            "The order number is 4471.",
            "Actually, make it an exchange for a bigger size.",
        ], "What does the customer want in the end?")),
        LabelledPlus("fruit prices", tb, False, _qa(RAG_SYSTEM, [
            "| fruit | price |\n|---|---|\n| apple | 1.20 |\n| pear | 0.90 |",
            "| plum | 2.10 |\n| fig | 3.40 |",
        ], "What does a fig cost?")),
        LabelledPlus("people csv", tb, False, _qa(RAG_SYSTEM, [
            "name,age,city\nAna,34,Lisbon\nBen,29,Oslo",
            "Cai,41,Lima\nDee,25,Quito",
        ], "How old is Cai?")),
        LabelledPlus("rainfall", tb, False, _qa(RAG_SYSTEM, [
            "| city | rain (mm) |\n|---|---|\n| Bergen | 2250 |",
            "| Oslo | 760 |",
            "| Rome | 800 |",
        ], "Which city gets 760 mm of rain?")),
        LabelledPlus("opening hours", tb, False, _qa(RAG_SYSTEM, [
            "The table below lists the opening hours of the library.",
            "| day | hours |\n|---|---|\n| Monday | 9-17 |",
            "| Saturday | 10-14 |",
        ], "When is the library open on Saturday?")),
        LabelledPlus("train times", tb, False, _qa(RAG_SYSTEM, [
            "station\tarrival\nLeeds\t09:10",
            "York\t09:40\nDurham\t10:25",
        ], "When does the train reach York?")),
        LabelledPlus("pancake list", tb, False, _qa(RAG_SYSTEM, [
            "For the pancakes you will need:",
            "- two eggs\n- a cup of flour\n- a pinch of salt",
        ], "What do you need for the pancakes?")),
        LabelledPlus("flight booking", ag, False, _tools(
            "Find the cheapest flight to Oslo and book it.",
            [("book_flight", {"flight": "SK123"})],
            [("search_flights", "SK123 at 89 EUR, DY456 at 120 EUR."),
             ("book_flight", "Booked SK123.")],
            earlier=[[("search_flights", {"to": "Oslo"})]])),
        LabelledPlus("file cleanup", ag, False, _tools(
            "Read notes.txt, then delete it.",
            [("delete_file", {"path": "notes.txt"})],
            [("read_file", "Buy milk and call Sam."), ("delete_file", "Deleted notes.txt.")],
            earlier=[[("read_file", {"path": "notes.txt"})]])),
    ]
    return [LabelledPlus(c.name, c.kind, c.commutes, c.query, _path(c.query)) for c in cases]


def _held_out() -> list[LabelledPlus]:
    """Cases written once the rules and the verdict's thresholds were fixed."""
    r, d, t = COMMUTING_KINDS
    s, st, dl, tb, _ = ORDERED_KINDS
    cases = [
        LabelledPlus("museum", r, True, _qa(RAG_SYSTEM, [
            "The Moll Museum opens at ten on weekdays.",
            "Tickets to the Moll Museum cost twelve euros for adults.",
            "The café of the museum serves soup and cake.",
        ], "How much is an adult ticket?")),
        LabelledPlus("bolero", r, True, _qa(RAG_SYSTEM, [
            "Ravel's Boléro was first performed in Paris in 1928.",
            "The Paris Opera ballet premiered many works by Stravinsky.",
            "Ida Rubinstein commissioned Boléro as a ballet.",
        ], "When was Boléro first performed?")),
        LabelledPlus("waterfalls", r, True, _qa(RAG_SYSTEM, [
            "It is the tallest waterfall in Norway, at 860 metres.",
            "Vinnufossen lies near Sunndalsøra in Møre og Romsdal.",
            "Mardalsfossen was once used for hydropower.",
        ], "How tall is the tallest waterfall in Norway?")),
        LabelledPlus("recipes", r, True, _qa(RAG_SYSTEM, [
            "Boil the pasta for nine minutes in salted water.",
            "Bake the lasagne for forty minutes at 180 °C.",
            "Grill the peppers until their skin turns black.",
        ], "How long do you boil the pasta?")),
        LabelledPlus("gym taglines", d, True, _qa(JUDGE_SYSTEM, [
            "Stronger every day.",
            "Your best workout starts here.",
            "Lift, run, repeat.",
        ], "What kind of business are these taglines for?", as_drafts=True)),
        LabelledPlus("canberra", d, True, _qa(JUDGE_SYSTEM, [
            "Canberra is the capital of Australia.",
            "The capital is Canberra, not Sydney.",
            "Australia's capital city is Canberra.",
        ], "Which city do all the answers name?", as_drafts=True)),
        LabelledPlus("exchange rates", t, True, _tools(
            "Which is worth more in dollars, a euro or a pound?",
            [("fx", {"from": "EUR", "to": "USD"}), ("fx", {"from": "GBP", "to": "USD"})],
            [("fx", "1 EUR = 1.08 USD"), ("fx", "1 GBP = 1.27 USD")])),
        LabelledPlus("danube", t, True, _tools(
            "How long is the Danube, and how many countries does it cross?",
            [("search", {"q": "Danube length"}), ("search", {"q": "Danube countries"})],
            [("search", "The Danube is 2,850 km long."),
             ("search", "The Danube flows through ten countries.")])),
        LabelledPlus("privacy settings", s, False, _qa(STEPS_SYSTEM, [
            "Open the app.",
            "Tap Settings.",
            "Choose Privacy and turn off location.",
        ], "What do you tap after opening the app?")),
        LabelledPlus("paper folding", s, False, _qa(STEPS_SYSTEM, [
            "Step one: fold the paper in half.",
            "Step two: fold the corners to the middle.",
            "Step three: fold the edges down.",
        ], "What is step two?")),
        LabelledPlus("bakery day", st, False, _qa(STORY_SYSTEM, [
            "The baker lit the oven before dawn.",
            "By seven the first loaves were cooling on the rack.",
            "At noon the shop had sold out.",
        ], "What happened at the end?")),
        LabelledPlus("lost keys", st, False, _qa(STORY_SYSTEM, [
            "Ben lost his keys at the park.",
            "Later that day, a dog brought them to his door.",
        ], "What happened after Ben lost his keys?")),
        LabelledPlus("meeting time", dl, False, _qa(RAG_SYSTEM, [
            "Nina: Are we still meeting at six?",
            "Omar: Can we make it seven?",
            "Nina: Seven works.",
        ], "When will they meet?")),
        LabelledPlus("pharmacy", dl, False, _qa(RAG_SYSTEM, [
            "Where is the nearest pharmacy?",
            "Two blocks north, next to the bank.",
            "Is it open on Sundays?",
        ], "What was asked last?")),
        LabelledPlus("moons", tb, False, _qa(RAG_SYSTEM, [
            "| planet | moons |\n|---|---|\n| Earth | 1 |\n| Mars | 2 |",
            "| Jupiter | 95 |",
        ], "How many moons does Jupiter have?")),
        LabelledPlus("library opening", st, False, _qa(RAG_SYSTEM, [
            "The committee met on Tuesday and decided that the new library would",
            "open in March, two months later than planned.",
        ], "When will the library open?")),
    ]
    return [LabelledPlus(c.name, c.kind, c.commutes, c.query, _path(c.query), held_out=True)
            for c in cases]


def labelled_set(held_out: bool = False) -> list[LabelledPlus]:
    """Every case: the commuting ones, then the order-dependent ones; with ``held_out``,
    then the cases written after the rules were fixed."""
    return _commuting() + _ordered() + (_held_out() if held_out else [])


__all__ = ["COMMUTING_KINDS", "ORDERED_KINDS", "LabelledPlus", "labelled_set"]
