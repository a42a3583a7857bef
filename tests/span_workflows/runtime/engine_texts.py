"""Documents and a question shared by the engine tests: three short invented facts."""

SYSTEM = "Answer the question using the documents."
A = ("The capital of Freedonia is Glimmerton, a city famous for its purple bridges and its "
     "annual kite festival held every spring on the river banks. ") * 2
B = ("Zorblax is a fictional metal that melts at twelve degrees Celsius; sculptors use it for "
     "ice art that must vanish before noon. ") * 2
C = ("The Blue Heron Inn serves breakfast from six to nine in the morning and closes every "
     "Tuesday so the staff can clean the old oak floors. ") * 2
QUESTION = "What is the capital of Freedonia?"


def lora_of(engine, result) -> str | None:
    """The adapter ``result`` ran on (``None``: the base), for raw requests and probes that
    must hash as its requests did."""
    return engine.router.named(result.metrics.weights).lora
