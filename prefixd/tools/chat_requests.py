"""gsp-shaped chat requests for a real model, and ``generate`` timed to its first token.

Shared by ``bench/e2e.py``, ``bench/vllm.py`` and ``make demo`` (``prefixd.tools.demo_model``),
with the flags both benchmarks take (``add_request_args``): a few long system
prompts (a made-up support desk's handbook, in English, ~1,500 tokens each by default), each
asked several short questions (~100 tokens). Every request is the chat template of (system,
user), so the system part is a token-exact prefix shared by all questions to that system.

``timed_generate`` runs greedy ``generate`` with transformers' own cache, or through a prefixd
session (``prefixd.client.hf.generate_with_prefix``), and measures the time to the first new
token with a streamer: the clock starts before anything of the request is done (the
sequence's ``Open`` included) and stops when ``generate`` hands out the first new token.
"""

from __future__ import annotations

import time
from typing import NamedTuple

_TOPICS = ["billing", "shipping", "returns", "warranty", "accounts", "privacy", "outages",
           "installation", "upgrades", "security", "refunds", "repairs"]
_PRODUCTS = ["the Aurora router", "the Basalt NAS", "the Cirrus camera", "the Delta thermostat",
             "the Ember speaker", "the Fjord tablet", "the Granite laptop", "the Harbor hub"]
_CITIES = ["Lisbon", "Osaka", "Denver", "Nairobi", "Oslo", "Lima", "Perth", "Quebec"]
_DESKS = ["Northwind Devices", "Bluebird Home", "Copperleaf Systems", "Driftwood Electronics"]
_RULES = [
    "Greet the customer by name when it is known and keep a calm, friendly tone.",
    "Never ask for a full card number, a password or a one-time code.",
    "Quote prices in the customer's local currency and say that taxes may apply.",
    "Offer a replacement before a refund when the item is under warranty.",
    "Explain each step in plain words and number the steps when there are more than two.",
    "If the customer is upset, acknowledge it in one sentence and move on to the fix.",
    "Escalate to a human agent when the customer asks twice or mentions a safety issue.",
    "Do not promise delivery dates; give the carrier's estimate and the tracking link.",
]


class ChatRequest(NamedTuple):
    system: int         # which system prompt
    question: int       # which question to that system
    input_ids: list[int]
    prefix_tokens: int  # tokens of the system part (shared with the other questions)


class Timed(NamedTuple):
    tokens: list[int]   # the new tokens
    ttft_s: float       # to the first new token
    total_s: float      # to the last
    cached_tokens: int  # prompt tokens the daemon had (0 without prefixd)


def system_prompt(index: int, approx_tokens: int) -> str:
    """A deterministic support-desk handbook of about ``approx_tokens`` tokens."""
    desk = _DESKS[index % len(_DESKS)]
    lines = [f"You are the support assistant of {desk} (handbook edition {index + 1}). "
             "Answer the customer's question briefly and correctly, following the policies below."]
    n = 0
    while sum(len(x) for x in lines) < approx_tokens * 4.2:  # ~4.2 characters per token in English
        topic = _TOPICS[(n + index) % len(_TOPICS)]
        product = _PRODUCTS[(n * 3 + index) % len(_PRODUCTS)]
        rule = _RULES[(n * 5 + index) % len(_RULES)]
        lines.append(f"Policy {n + 1} ({topic}, {product}): customers who contact {desk} about "
                     f"{topic} for {product} must be told what we can do within {n % 5 + 2} "
                     f"business days. {rule}")
        n += 1
    return "\n".join(lines)


def question(system: int, index: int) -> str:
    """A deterministic customer question of about 100 tokens."""
    topic = _TOPICS[(index * 7 + system) % len(_TOPICS)]
    product = _PRODUCTS[(index + system * 3) % len(_PRODUCTS)]
    city = _CITIES[(index * 3 + system) % len(_CITIES)]
    return (f"Hello, my name is Sam and I live in {city}. I bought {product} about "
            f"{index + 2} months ago and I have a question about {topic}. Yesterday it stopped "
            f"working after an update, and the light on the front blinks orange {index + 3} times. "
            f"I already restarted it twice and checked the cables. What exactly should I do now, "
            f"and how long will it take? Please answer in two sentences.")


def build_requests(tokenizer, num_systems: int, num_questions: int, system_tokens: int) -> list[ChatRequest]:
    """Requests in the order they are served: system by system, question by question."""
    out = []
    for s in range(num_systems):
        sys_text = system_prompt(s, system_tokens)
        prefix = tokenizer.apply_chat_template([{"role": "system", "content": sys_text}], tokenize=False)
        prefix_len = len(tokenizer(prefix, add_special_tokens=False)["input_ids"])
        for q in range(num_questions):
            text = tokenizer.apply_chat_template(
                [{"role": "system", "content": sys_text}, {"role": "user", "content": question(s, q)}],
                tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if ids[:prefix_len] != tokenizer(prefix, add_special_tokens=False)["input_ids"]:
                raise ValueError("the chat template does not keep the system part a token prefix")
            out.append(ChatRequest(s, q, ids, prefix_len))
    return out


def add_request_args(parser, quick: dict) -> None:
    """The flags ``bench/e2e.py`` and ``bench/vllm.py`` share: ``--json``, ``--quick`` (the
    sizes ``quick`` names) and the requests' shape, ``--systems``, ``--questions``,
    ``--system-tokens`` and ``--new-tokens`` (unset: the run's default, ``request_params``)."""
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--quick", action="store_true", help="a small smoke run (%s)" % quick)
    parser.add_argument("--systems", type=int)
    parser.add_argument("--questions", type=int)
    parser.add_argument("--system-tokens", type=int)
    parser.add_argument("--new-tokens", type=int)


def request_params(args, full: dict, quick: dict) -> dict:
    """The run's sizes: ``quick`` with ``--quick``, else ``full``, each key that ``args`` sets
    (a flag of the same name, not None) taking its value."""
    params = dict(quick if args.quick else full)
    for key in params:
        if getattr(args, key) is not None:
            params[key] = getattr(args, key)
    return params


class _FirstToken:
    """A ``generate`` streamer that notes when the first new token comes out."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_at: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_at is None:  # call 1 is the prompt itself
            self.first_at = time.perf_counter()

    def end(self) -> None:
        pass


def timed_generate(model, input_ids: list[int], max_new_tokens: int, session=None) -> Timed:
    """Greedy ``generate`` of one prompt; through ``session`` (prefixd) when given.

    Raises whatever ``generate`` raises (``DaemonRestarted`` when the daemon restarted during it).
    """
    import torch

    ids = torch.tensor([input_ids], dtype=torch.long)
    mask = torch.ones_like(ids)
    streamer = _FirstToken()
    kwargs = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                  streamer=streamer)
    cached = 0
    with torch.inference_mode():
        t0 = time.perf_counter()
        if session is None:
            out = model.generate(ids, **kwargs)
        else:
            from prefixd.client.hf import PrefixdCache

            with PrefixdCache(session, model, ids, mask) as cache:
                out = model.generate(ids, past_key_values=cache, **kwargs)
                cached = int(cache.cached_tokens[0]) if cache.cached_tokens else 0
        t1 = time.perf_counter()
    first = streamer.first_at if streamer.first_at is not None else t1
    return Timed(out[0, len(input_ids):].tolist(), first - t0, t1 - t0, cached)
