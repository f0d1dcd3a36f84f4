"""Every command's argument parser: flags are matched whole. argparse's default takes any
unambiguous prefix (``--zer 1`` as ``--zero 1``), so a flag added later could change what a
typed prefix means; here a prefix is refused, naming the flags it could mean. An error is one
line, without argparse's usage block (``--help`` prints it)."""
from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser with ``allow_abbrev`` off (its subcommands' parsers too) and
    an unknown flag that begins a known one refused as such."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def flags(self) -> set:
        """This parser's long flags and those of its subcommands' parsers."""
        out = {s for a in self._actions for s in a.option_strings if s.startswith("--")}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    out |= sub.flags() if isinstance(sub, Parser) else {
                        s for a in sub._actions for s in a.option_strings}
        return out

    def explain(self, message: str) -> str:
        """``message``, or for an unrecognized prefix of known flags the flags it could
        mean."""
        if not message.startswith("unrecognized arguments:"):
            return message
        known = self.flags()
        for token in message.split(":", 1)[1].split():
            typed = token.split("=", 1)[0]
            could = sorted(f for f in known if typed.startswith("--") and f.startswith(typed))
            if could:
                return (f"{typed} is not a flag (flags are matched whole, not by a prefix): "
                        f"did you mean {' or '.join(could)}?")
        return message

    def error(self, message):
        """One line and exit 2 (argparse prints its usage first: --help has it)."""
        self.exit(2, f"{self.prog}: error: {self.explain(message)}\n")
