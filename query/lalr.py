"""A lean driver for a Lark LALR parser: Lark's own parse table, a one-regex lexer.

Lark builds the tables from ``grammar.lark`` and stays the reference: it explains every
text this driver refuses (``parse`` returns ``None`` and the caller asks Lark, which
raises its exceptions with expected tokens). The driver only does the accepting path,
about twice as fast as Lark's: Lark lexes through a chain of objects per token and
calls each rule's callback through three or four wrappers, which for a query's few
dozen tokens is most of its parse time.

It reproduces what Lark's contextual lexer and its tree shaping do for this grammar, and
refuses to build for a grammar using anything else:

- **Lexing.** One alternation of all terminals, in the order Lark's lexer tries them
  (priority, then longest pattern first). A word a keyword's string is spelled like is
  read by the name-like terminal and becomes the keyword only where the parser state
  accepts the keyword, as the contextual lexer has it (so ``meta.limit`` is a key).
  Any other token the state does not accept ends the fast path: Lark decides.
- **Shaping.** A rule's children lose filtered tokens (``_KEYWORD``, anonymous
  punctuation), gain ``None`` for each absent ``[optional]``, splice in Lark's internal
  ``__rule`` repetitions, and go, as positional arguments, to the builder's method named
  by the rule's alias or name; an inlined ``?rule`` with one child is that child.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from typing import Any

from lark import Lark, Token
from lark.parsers.lalr_analysis import Shift

__all__ = ["LeanLALR"]

#: (children popped, the rule's name, the callback; None: the one child stays as it is)
_Reduce = tuple[int, str, Callable[[list[Any]], Any] | None]
_new_str = str.__new__


class LeanLALR:
    """Parses with ``lark``'s tables (a LALR :class:`~lark.Lark` built with
    ``maybe_placeholders=True``), calling ``builder``'s methods at each reduction."""

    def __init__(self, lark: Lark, builder: object):
        if lark.options.parser != "lalr" or lark.options.lexer != "contextual":
            raise ValueError("LeanLALR follows a LALR parser with the contextual lexer")
        conf = lark.parse_interactive("").parser_state.parse_conf
        self._start, self._end = conf.start_state, conf.end_state
        self._lexer, self._keywords = _lexer(lark)
        if any(hasattr(builder, t.name) for t in lark.terminals):
            raise ValueError("LeanLALR calls no builder methods for terminals")
        reducers: dict[Any, _Reduce] = {}
        # state -> token type -> next state (a shift) or what to reduce
        self._states: dict[Any, dict[str, Any]] = {}
        for state, actions in conf.states.items():
            table: dict[str, Any] = {}
            for symbol, (action, arg) in actions.items():
                if action is Shift:
                    table[str(symbol)] = arg
                else:
                    if arg not in reducers:
                        reducers[arg] = _reducer(arg, builder)
                    table[str(symbol)] = reducers[arg]
            self._states[state] = table

    def parse(self, text: str) -> Any | None:
        """What the builder makes of ``text``, or ``None`` where Lark must decide. The
        builder's exceptions propagate: they are what Lark's run would meet too."""
        states, end = self._states, self._end
        match, keywords = self._lexer.match, self._keywords
        state_stack = [self._start]
        value_stack: list[Any] = []
        lines = [m.start() for m in _NEWLINE.finditer(text)]
        pos, size = 0, len(text)
        token: Token | None
        while True:
            m = match(text, pos)  # whitespace, then one token (none at the end)
            kind = m.lastgroup  # type: ignore[union-attr]
            actions = states[state_stack[-1]]
            if kind is None:
                if m.end() < size:  # type: ignore[union-attr]
                    return None  # a character no terminal starts with
                kind, token = "$END", None
            else:
                start, stop = m.span(kind)  # type: ignore[union-attr]
                value = text[start:stop]
                keyword = keywords.get(kind)
                if keyword is not None:
                    word = keyword.get(value.lower())
                    if word is not None and word in actions:
                        kind = word
                token = _token(kind, value, text, start, stop, lines)
                pos = stop
            while True:
                action = actions.get(kind)
                if action is None:
                    return None
                if action.__class__ is not tuple:  # a shift
                    if token is None:
                        return None
                    state_stack.append(action)
                    value_stack.append(token)
                    break
                count, origin, reduce = action
                if reduce is None:  # an inlined ?rule's one child: it stays as it is
                    del state_stack[-1]
                elif count:
                    children = value_stack[-count:]
                    del state_stack[-count:]
                    del value_stack[-count:]
                    value_stack.append(reduce(children))
                else:
                    value_stack.append(reduce([]))
                target = states[state_stack[-1]][origin]
                if token is None and target == end:
                    return value_stack[-1]
                state_stack.append(target)
                actions = states[target]


_NEWLINE = re.compile("\n")


def _token(kind: str, value: str, text: str, start: int, stop: int, lines: list[int]) -> Token:
    """A Lark token (the builder reads its type and positions), made without Lark's
    keyword-argument handling; lines and columns count from 1. ``lines``: where the
    text's newlines are (found by bisection: a long text costs no rescans)."""
    token = _new_str(Token, value)
    token.type, token.value, token.start_pos, token.end_pos = kind, value, start, stop
    if lines:
        before = bisect.bisect_left(lines, start)  # newlines before the token
        token.line = before + 1
        token.column = start - (lines[before - 1] if before else -1)
        after = bisect.bisect_left(lines, stop)
        token.end_line = after + 1
        token.end_column = stop - (lines[after - 1] if after else -1)
    else:
        token.line = token.end_line = 1
        token.column, token.end_column = start + 1, stop + 1
    return token


def _lexer(lark: Lark) -> tuple[re.Pattern[str], dict[str, dict[str, str]]]:
    """One pattern: what Lark ignores, then one of the terminals in Lark's order (or none,
    at the end of the text); and the keywords each name-like terminal reads (its
    terminal -> lower-cased spelling -> the keyword)."""
    if lark.options.g_regex_flags or lark.options.lexer_callbacks or lark.options.postlex:
        raise ValueError("LeanLALR does not follow lexer flags, callbacks or post-lexers")
    terminals = sorted(
        lark.terminals,
        key=lambda t: (-t.priority, -t.pattern.max_width, -len(t.pattern.value), t.name),
    )
    ignore = [t.pattern.to_regexp() for t in terminals if t.name in lark.ignore_tokens]
    patterns = {t.name: re.compile(t.pattern.to_regexp()) for t in terminals}
    keywords: dict[str, dict[str, str]] = {}
    groups = []
    for t in terminals:
        if t.name in lark.ignore_tokens:
            continue
        if t.pattern.type == "str":
            words = [
                r
                for r in terminals
                if r.pattern.type == "re" and patterns[r.name].fullmatch(t.pattern.value)
            ]
            if words:
                if (
                    len(words) > 1
                    or words[0].pattern.flags != t.pattern.flags
                    or "i" not in t.pattern.flags
                ):
                    raise ValueError(f"LeanLALR cannot lex keyword {t.name} of this grammar")
                keywords.setdefault(words[0].name, {})[t.pattern.value.lower()] = t.name
                continue
        groups.append(f"(?P<{t.name}>{t.pattern.to_regexp()})")
    skip = f"(?:{'|'.join(ignore)})*" if ignore else ""
    return re.compile(f"{skip}(?:{'|'.join(groups)})?"), keywords


def _reducer(rule: Any, builder: object) -> _Reduce:
    """(children popped, the rule's name, a callback shaping them as Lark would)."""
    options = rule.options
    if options.keep_all_tokens:
        raise ValueError(f"LeanLALR does not keep all tokens (rule {rule.origin.name})")
    empty = list(options.empty_indices) or [False] * len(rule.expansion)
    plan: list[tuple[int, bool, int]] = []  # (child, splice it, Nones before it)
    nones = position = 0
    for flag in empty:
        if flag:  # an absent [optional] stood here
            nones += 1
            continue
        sym = rule.expansion[position]
        if not (sym.is_term and sym.filter_out):
            plan.append((position, not sym.is_term and sym.name.startswith("_"), nones))
            nones = 0
        position += 1
    name = rule.alias or options.template_source or rule.origin.name
    method = getattr(builder, name, None)
    build: Callable[..., Any]
    if method is not None:
        build = method
    elif name.startswith("_"):  # Lark's own repetition rules: spliced into the parent

        def build(*items: Any) -> list[Any]:
            return list(items)
    elif options.expand1 and len(rule.expansion) == 1 and plan == [(0, False, 0)] and not nones:
        return 1, str(rule.origin.name), None  # an inlined ?rule's one child
    else:
        raise ValueError(f"the builder has no method for rule {name!r}")
    expand1 = options.expand1 and not rule.alias
    simple = not nones and all(not splice and not before for _, splice, before in plan)
    picks = tuple(i for i, _, _ in plan)

    if simple and picks == tuple(range(len(rule.expansion))):

        def reduce(children: list[Any]) -> Any:
            if expand1 and len(children) == 1:
                return children[0]
            return build(*children)
    elif simple:

        def reduce(children: list[Any]) -> Any:
            args = [children[i] for i in picks]
            if expand1 and len(args) == 1:
                return args[0]
            return build(*args)
    else:
        # A repetition (``_rule: _rule item | item``) reduces once an item, its first
        # child the list built so far: extended in place, not copied, so a long list
        # (an `in` list, a chain of `and`s) costs linear time, not quadratic. The list
        # is one the ``_`` rule's own ``build`` made, and only this reduction holds it.
        grows = bool(plan) and plan[0][1] and plan[0][2] == 0 and method is None
        first, rest = (plan[0][0], plan[1:]) if grows else (-1, plan)

        def reduce(children: list[Any]) -> Any:
            args: list[Any] = children[first] if grows else []
            for i, splice, before in rest:
                args += [None] * before
                if splice:
                    args += children[i]
                else:
                    args.append(children[i])
            args += [None] * nones
            if expand1 and len(args) == 1:
                return args[0]
            return args if grows else build(*args)

    return len(rule.expansion), str(rule.origin.name), reduce
