"""The two-tool task both agent tests run: a question that needs the weather tool and the
population tool, whose answers are made up so only the tools can know them."""

from __future__ import annotations

QUESTION = "What is the weather in Varnholm, and how many people live in Varnholm?"
SYSTEM = ("You are a helpful assistant. Use the tools to look facts up, then answer "
          "the question in one sentence.")
WEATHER = "Foggy and 11 degrees in {city}."
POPULATION = "{city} has 48,200 inhabitants."


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return WEATHER.format(city=city)


def get_population(city: str) -> str:
    """How many people live in a city."""
    return POPULATION.format(city=city)
