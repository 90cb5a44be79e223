"""One table for every figure and results table: the order policies appear in, their colour, their label.

``POLICY_TABLE`` lists the shipped policies: its order is the order of tables and legends, the paper's
order (position rules, then scores that read keys, then scores that read attention, then rmm and the
oracle). A policy registered without an entry is defaulted: it comes last, labelled by its name, in a
colour of ``SPARE_COLORS`` chosen by its name, so that it never shares one with a tabled policy.
``WEIGHT_COLORS`` gives each of rmm's weights (``policy.weight``, which the smoother shares) its own
colour for figures that draw one line per weight.
Labels are the config names, so that a reader can type what a legend shows.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple


class PolicyStyle(NamedTuple):
    label: str
    color: str


POLICY_TABLE: dict[str, PolicyStyle] = {
    "full": PolicyStyle("full", "black"),
    "window": PolicyStyle("window", "tab:gray"),
    "streaming_llm": PolicyStyle("streaming_llm", "tab:blue"),
    "random": PolicyStyle("random", "tab:olive"),
    "knorm": PolicyStyle("knorm", "tab:cyan"),
    "keydiff": PolicyStyle("keydiff", "teal"),
    "lagkv": PolicyStyle("lagkv", "slateblue"),
    "expected_attention": PolicyStyle("expected_attention", "darkslategray"),
    "tova": PolicyStyle("tova", "tab:purple"),
    "snapkv": PolicyStyle("snapkv", "tab:pink"),
    "lru": PolicyStyle("lru", "goldenrod"),
    "h2o": PolicyStyle("h2o", "tab:orange"),
    "observed_attention": PolicyStyle("observed_attention", "sienna"),
    "restkv": PolicyStyle("restkv", "magenta"),
    "rmm": PolicyStyle("rmm", "tab:red"),
    "oracle": PolicyStyle("oracle", "tab:green"),
}
WEIGHT_COLORS = {"correct": "tab:red", "prob": "darkmagenta", "uniform": "dimgray", "gradient": "saddlebrown"}
SPARE_COLORS = ("darkkhaki", "navy", "olivedrab", "deeppink", "peru", "lightseagreen", "indigo", "crimson")


def policy_sort_key(policy: str) -> tuple[int, str]:
    """Order policies as in the paper's tables, unknown ones last (alphabetically)."""
    order = list(POLICY_TABLE)
    return (order.index(policy) if policy in POLICY_TABLE else len(order), policy)


def policy_color(policy: str) -> str:
    style = POLICY_TABLE.get(policy)
    return style.color if style else SPARE_COLORS[zlib.crc32(policy.encode()) % len(SPARE_COLORS)]


def policy_label(policy: str) -> str:
    style = POLICY_TABLE.get(policy)
    return style.label if style else policy
