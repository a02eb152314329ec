"""User-facing text speaks of the product only: the CLI's help (every command) names no issue, session,
attempt or "here" (a machine the reader does not have), and offers no deprecated choice."""

import argparse
import re

import pytest

from flwr_inca.cli import build_parser

# words that only make sense to whoever wrote the text: where it was measured, what it was asked in
OUTSIDE_WORDS = re.compile(r"\b(issues?|here|sessions?|attempts?|branch|the lead)\b|< ?\d+ ?min",
                           re.IGNORECASE)
DEPRECATED_ACCOUNTANTS = {"prv", "rdp", "gdp"}


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:  # argparse exposes subcommands only through its actions
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_help_text_speaks_of_the_product_only():
    found = {}
    for parser in _parsers(build_parser()):
        text = " ".join(parser.format_help().split())
        hits = sorted({m.group(0) for m in OUTSIDE_WORDS.finditer(text)})
        if hits:
            found[parser.prog] = hits
    assert not found, f"help texts with words from outside the product: {found}"


def test_no_command_offers_a_deprecated_accountant_name():
    for parser in _parsers(build_parser()):
        for action in parser._actions:
            if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
                assert not DEPRECATED_ACCOUNTANTS & set(action.choices), (parser.prog, action.option_strings)


def test_a_deprecated_accountant_name_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["simulate", "--accountant", "prv"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2 and "--accountant" in err and "'opacus-prv'" in err
