"""Synthetic tool-use conversations for celeris-tiny's tools phase (engine/training/train.py).

Each example is a chat rendered with the template the tokenizer ships, with a drawn tool list,
and a response in exactly the text the template writes for an assistant's calls (hermes:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several joined by "\\n", as
enforcement writes them, engine/agents/parsers.py), then EOS padding to a drawn canvas. Four kinds:

- a request one listed tool answers -> one call, its arguments copied from the request;
- a request about two things ("... in Paris and in Rome", "the time in X and the weather in Y")
  -> two calls;
- a request no listed tool answers (an addition such as "What is 2+2?", a "Continue:" turn, a
  "Which novel is this from?" turn) -> the plain answer, as the model gives it without tools;
- a tool result after a call -> a short sentence that uses it.

Long rows (`long_example`) put Austen paragraphs before the request (a system prompt or
a document in the user turn) so the prompt reaches `max_len` tokens: the model sees the
positions an agent's prompt reaches and learns to answer the request at the end of it.
Cities and phrasings are drawn from fixed lists; tool sets are drawn per example from
`TOOLS`, so names, parameter names and order vary.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Callable, Optional

from celeris.engine.training.tasks import Example

CITIES = (
    "Paris", "Rome", "London", "Berlin", "Madrid", "Lisbon", "Vienna", "Prague", "Warsaw", "Dublin", "Oslo",
    "Stockholm", "Helsinki", "Copenhagen", "Amsterdam", "Brussels", "Zurich", "Geneva", "Athens", "Istanbul",
    "Cairo", "Nairobi", "Lagos", "Tokyo", "Osaka", "Seoul", "Beijing", "Shanghai", "Delhi", "Mumbai",
    "Bangkok", "Singapore", "Jakarta", "Manila", "Sydney", "Melbourne", "Auckland", "Toronto", "Montreal",
    "Vancouver", "Chicago", "Boston", "Seattle", "Denver", "Austin", "Miami", "Dallas", "Houston", "Atlanta",
    "Lima", "Bogota", "Santiago", "Quito", "Havana", "Mexico City", "New York", "San Francisco", "Los Angeles",
    "Buenos Aires", "Rio de Janeiro", "Cape Town", "Hong Kong", "Kyoto", "Milan", "Naples", "Venice", "Florence",
    "Munich", "Hamburg", "Lyon", "Marseille", "Nice", "Bordeaux", "Seville", "Valencia", "Porto", "Krakow",
    "Budapest", "Bucharest", "Sofia", "Belgrade", "Zagreb", "Riga", "Tallinn", "Vilnius", "Kiev", "Minsk",
    "Edinburgh", "Glasgow", "Manchester", "Bristol", "Cardiff", "Belfast", "Bath", "Oxford", "Cambridge",
)
UNITS = ("celsius", "fahrenheit")
SYMBOLS = ("AAPL", "MSFT", "GOOG", "AMZN", "TSLA", "NVDA", "IBM", "ORCL", "INTC", "META", "SAP", "ASML")
TOPICS = ("the history of tea", "river fishing", "Bath in winter", "the price of bread", "old carriages",
          "country dances", "letters by post", "naval officers", "the Napoleonic wars", "garden roses",
          "how pianos work", "the moon landing", "solar panels", "train timetables", "the tallest mountain")
LANGUAGES = ("French", "German", "Spanish", "Italian", "Japanese", "Dutch", "Polish")
PHRASES = ("good morning", "thank you very much", "where is the station", "I am lost", "the weather is fine")


def _fn(name: str, description: str, props: dict, required: list[str]) -> dict:
    params = {"type": "object", "properties": props, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def _str(description: str = "", **kw) -> dict:
    return {"type": "string", **({"description": description} if description else {}), **kw}


@dataclass(frozen=True)
class ToolKind:
    """One tool as listed (OpenAI-shaped), what it is for and how a request and result read."""
    spec: dict
    topic: str  # "weather", "time", "stock", "search", "translate", "email", "other"
    slot: str  # the argument a request fills ("city", "symbol", ...)

    @property
    def name(self) -> str:
        return self.spec["function"]["name"]


def _weather(name: str, key: str, unit: bool, desc: str) -> ToolKind:
    props = {key: _str("The city, e.g. Paris")}
    if unit:
        props["unit"] = {"type": "string", "enum": list(UNITS)}
    return ToolKind(_fn(name, desc, props, [key]), "weather", key)


TOOLS: tuple[ToolKind, ...] = (
    _weather("get_weather", "city", False, "Weather in a city"),
    _weather("get_weather", "city", True, "Get the current weather in a given city"),
    _weather("get_current_weather", "location", True, "Get the current weather in a given location"),
    _weather("weather_now", "city", False, "Current conditions and temperature for a city"),
    ToolKind(_fn("get_time", "The local time in a city", {"city": _str()}, ["city"]), "time", "city"),
    ToolKind(_fn("get_local_time", "Current local time for a place", {"place": _str("A city name")}, ["place"]),
             "time", "place"),
    ToolKind(_fn("get_stock_price", "Latest price of a stock", {"symbol": _str("Ticker, e.g. AAPL")}, ["symbol"]),
             "stock", "symbol"),
    ToolKind(_fn("search_web", "Search the web", {"query": _str("What to search for")}, ["query"]), "search", "query"),
    ToolKind(_fn("translate", "Translate text", {"text": _str(), "target_language": _str()},
                 ["text", "target_language"]), "translate", "text"),
    ToolKind(_fn("send_email", "Send an email", {"to": _str("Address"), "subject": _str(), "body": _str()},
                 ["to", "subject", "body"]), "email", "to"),
    ToolKind(_fn("create_calendar_event", "Add an event to the calendar",
                 {"title": _str(), "date": _str("YYYY-MM-DD")}, ["title", "date"]), "other", "title"),
    ToolKind(_fn("get_exchange_rate", "Exchange rate between two currencies",
                 {"base": _str("e.g. EUR"), "quote": _str("e.g. USD")}, ["base", "quote"]), "other", "base"),
    ToolKind(_fn("play_music", "Play a song", {"song": _str()}, ["song"]), "other", "song"),
    ToolKind(_fn("set_timer", "Start a timer", {"minutes": {"type": "integer", "minimum": 1}}, ["minutes"]),
             "other", "minutes"),
)

WEATHER_ASKS = ("What is the weather in {c}?", "What's the weather like in {c}?", "What's the weather in {c} today?",
                "How is the weather in {c}?", "Is it raining in {c}?", "Weather in {c}?", "weather in {c}",
                "Tell me the weather in {c}.", "How warm is it in {c} right now?", "Will it be sunny in {c}?",
                "What is the temperature in {c}?", "Can you check the weather in {c}?")
WEATHER_PAIRS = ("What is the weather in {a} and in {b}?", "What's the weather in {a} and {b}?",
                 "weather in {a} and in {b}", "Compare the weather in {a} and {b}.",
                 "How is the weather in {a} and in {b} today?", "Is it raining in {a} or in {b}?")
TIME_ASKS = ("What time is it in {c}?", "What is the local time in {c}?", "Current time in {c}?",
             "time in {c}")
MIXED_PAIRS = ("What time is it in {a} and what is the weather in {b}?",
               "Tell me the time in {a} and the weather in {b}.")
STOCK_ASKS = ("What is the price of {s}?", "How is {s} trading?", "Stock price of {s}?", "Quote {s} for me.")
SEARCH_ASKS = ("Search the web for {q}.", "Look up {q}.", "Find something about {q}.", "Search for {q}")
TRANSLATE_ASKS = ("Translate \"{t}\" into {l}.", "How do you say \"{t}\" in {l}?")
EMAIL_ASKS = ("Send an email to {to} saying {b}.", "Email {to}: {b}")
NAMES = ("anna", "tom", "lucy", "james", "emma", "john", "mary", "harriet", "fanny", "edward")


class ToolTaskMaker:
    """Draws tool-use examples. `render(messages, tools) -> prompt ids` (the served chat template,
    generation prompt included); `encode(text) -> ids` (no BOS); `plain()` -> (question, answer
    text) of a turn no tool answers; `filler(n_tokens)` -> that many tokens' worth of prose."""

    def __init__(self, render: Callable[[list[dict], list[dict]], list[int]], encode: Callable[[str], list[int]],
                 plain: Callable[[random.Random], tuple[str, str]], filler: Callable[[random.Random, int], str],
                 eos_id: int, seed: int):
        self.render, self.encode, self.plain, self.filler = render, encode, plain, filler
        self.eos, self.rng = eos_id, random.Random(seed)

    # -- tool lists -------------------------------------------------------------------------
    def toolset(self, must: tuple[ToolKind, ...] = (), avoid: tuple[str, ...] = (), most: int = 3,
                least: int = 0) -> list[ToolKind]:
        """`must` plus `least`..`most`-len(must) other tools (one of each name, none of `avoid`'s
        topics), shuffled."""
        names = {t.name for t in must}
        pool = [t for t in TOOLS if t.name not in names and t.topic not in avoid]
        self.rng.shuffle(pool)
        chosen = list(must)
        for t in pool[:self.rng.randint(least, max(least, most - len(must)))]:
            if t.name not in {c.name for c in chosen}:
                chosen.append(t)
        self.rng.shuffle(chosen)
        return chosen

    def _pick(self, topic: str) -> ToolKind:
        return self.rng.choice([t for t in TOOLS if t.topic == topic])

    # -- requests ---------------------------------------------------------------------------
    def _request(self, tool: ToolKind) -> tuple[str, dict]:
        """(request text, the call's arguments) for one tool."""
        r = self.rng
        if tool.topic == "weather":
            city = r.choice(CITIES)
            ask = r.choice(WEATHER_ASKS).format(c=city)
            args = {tool.slot: city}
            if "unit" in tool.spec["function"]["parameters"]["properties"] and r.random() < 0.3:
                unit = r.choice(UNITS)
                ask = ask.rstrip("?.") + f" in {unit}?"
                args["unit"] = unit
            return ask, args
        if tool.topic == "time":
            city = r.choice(CITIES)
            return r.choice(TIME_ASKS).format(c=city), {tool.slot: city}
        if tool.topic == "stock":
            s = r.choice(SYMBOLS)
            return r.choice(STOCK_ASKS).format(s=s), {"symbol": s}
        if tool.topic == "search":
            q = r.choice(TOPICS)
            return r.choice(SEARCH_ASKS).format(q=q), {"query": q}
        if tool.topic == "translate":
            t, lang = r.choice(PHRASES), r.choice(LANGUAGES)
            return r.choice(TRANSLATE_ASKS).format(t=t, l=lang), {"text": t, "target_language": lang}
        if tool.topic == "email":
            to, body = f"{r.choice(NAMES)}@example.com", r.choice(("I am late", "see you soon", "thank you"))
            return r.choice(EMAIL_ASKS).format(to=to, b=body), {"to": to, "subject": body, "body": body}
        raise ValueError(f"no requests for {tool.topic}")

    def _calls_text(self, calls: list[tuple[str, dict]]) -> str:
        """The calls exactly as the template writes them (and enforcement, parsers.HermesParser)."""
        return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a, ensure_ascii=False)}}}\n'
                         f"</tool_call>" for n, a in calls)

    def _example(self, turn: "Turn", canvas: int) -> Example:
        ids = self.encode(turn.answer)
        canvas = max(canvas, len(ids) + 1)  # never cut a call: the canvas grows to hold it and one EOS
        return Example(self.render(turn.messages, [t.spec for t in turn.tools]),
                       ids + [self.eos] * (canvas - len(ids)))

    def call(self) -> "Turn":
        tool = self._pick(self.rng.choice(("weather", "weather", "weather", "time", "stock", "search",
                                           "translate", "email")))
        ask, args = self._request(tool)
        tools = self.toolset((tool,), avoid=(tool.topic,))
        return Turn([{"role": "user", "content": ask}], tools, self._calls_text([(tool.name, args)]))

    def two_calls(self) -> "Turn":
        a, b = self.rng.sample(CITIES, 2)
        if self.rng.random() < 0.75:
            tool = self._pick("weather")
            tools = self.toolset((tool,), avoid=("weather",))
            ask = self.rng.choice(WEATHER_PAIRS).format(a=a, b=b)
            calls = [(tool.name, {tool.slot: a}), (tool.name, {tool.slot: b})]
        else:
            clock, weather = self._pick("time"), self._pick("weather")
            tools = self.toolset((clock, weather), avoid=("weather", "time"))
            ask = self.rng.choice(MIXED_PAIRS).format(a=a, b=b)
            calls = [(clock.name, {clock.slot: a}), (weather.name, {weather.slot: b})]
        return Turn([{"role": "user", "content": ask}], tools, self._calls_text(calls))

    def no_tool(self) -> "Turn":
        question, answer = self.plain(self.rng)
        return Turn([{"role": "user", "content": question}], self.toolset(most=3, least=1), answer)

    def result(self) -> "Turn":
        tool = self._pick(self.rng.choice(("weather", "weather", "time")))
        ask, args = self._request(tool)
        place = args[tool.slot]
        if tool.topic == "weather":
            temp, sky = self.rng.randint(-5, 35), self.rng.choice(("sunny", "cloudy", "raining", "windy", "snowing"))
            content = json.dumps(self.rng.choice(({"temp_c": temp, "condition": sky},
                                                  {"temperature": temp, "sky": sky})))
            answer = self.rng.choice((f"It is {temp} degrees and {sky} in {place}.",
                                      f"In {place} it is {sky}, {temp} degrees."))
        else:
            hour, minute = self.rng.randint(0, 23), self.rng.randint(0, 59)
            content = json.dumps({"time": f"{hour:02d}:{minute:02d}"})
            answer = f"It is {hour:02d}:{minute:02d} in {place}."
        call = {"id": "call_1", "type": "function", "function": {"name": tool.name, "arguments": json.dumps(args)}}
        messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": content}]
        return Turn(messages, self.toolset((tool,), avoid=(tool.topic,)), answer)

    def turn(self) -> "Turn":
        kind = self.rng.random()
        if kind < 0.40:
            return self.call()
        if kind < 0.60:
            return self.two_calls()
        if kind < 0.85:
            return self.no_tool()
        return self.result()

    def example(self, canvas: int) -> Example:
        return self._example(self.turn(), canvas)

    def long_example(self, max_len: int, canvas: int) -> Example:
        """One example of at most `max_len` tokens in all whose prompt is mostly prose before the
        request (a system prompt, or a document in the user turn): the positions an agent's
        prompt reaches, with the request at its end."""
        turn = self.turn()
        short = self._example(turn, canvas)
        room = max_len - len(short.prompt) - len(short.response) - 8
        best = short
        for _ in range(3):  # the filler's ids re-tokenize within the template a little differently
            if room <= 0:
                break
            text = self.filler(self.rng, room)
            if self.rng.random() < 0.5:
                messages = [{"role": "system", "content": text}, *turn.messages]
            else:
                first = turn.messages[0]
                messages = [{**first, "content": f"{text}\n\n{first['content']}"}, *turn.messages[1:]]
            e = self._example(Turn(messages, turn.tools, turn.answer), canvas)
            over = len(e.prompt) + len(e.response) - max_len
            if over <= 0:
                return e
            room -= over + 8
        return best


@dataclass(frozen=True)
class Turn:
    messages: list[dict]
    tools: list[ToolKind]
    answer: str  # the response text: calls as the template writes them, or plain text
