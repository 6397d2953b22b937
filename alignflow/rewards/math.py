"""A math-answer verifier: does a response's final answer equal the reference answer?

Answers are read from the end of the response: a `\\boxed{...}`, else the text after the last
"answer is" / "answer:" / "####", else the last number or expression on the last line that has one.
Both sides are parsed by a small parser of our own into exact sympy values (never `eval`, nor
sympy's `parse_expr`, which evaluates Python: a policy's output must not run as code), and compared
exactly: integers, decimals, thousands separators, fractions (`3/4`, `\\frac{3}{4}`, `\\dfrac`),
percentages, signs, `+ - * / ^ ( )`, `sqrt`, `pi` and implicit products (`2sqrt(2)`, `3pi`). An
answer that does not parse scores 0, never an error.
"""

from __future__ import annotations

import re

import sympy

_NUMBER = re.compile(r"\d+(?:,\d{3})+(?:\.\d+)?|\d+\.\d*|\.\d+|\d+")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_SQRT = re.compile(r"\\sqrt\s*\{([^{}]*)\}")
_MARKERS = re.compile(r"(?:final answer|answer)\s*(?:is|:|=)\s*|####\s*", re.IGNORECASE)
# A stretch of text that may be an answer: numbers, operators, parentheses, \frac / \sqrt / pi, spaces.
_SPAN = re.compile(r"(?:\\[dt]?frac\s*\{[^{}]*\}\s*\{[^{}]*\}|\\sqrt\s*\{[^{}]*\}|(?<![a-z])\\?sqrt|(?<![a-z])\\?pi(?![a-z])|\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+"
                   r"|[-+*/^()%]| )+")
_MAX_CHARS = 200  # an answer longer than this is no final answer; also bounds the parser's work
_MAX_EXPONENT = 64
_MAX_BITS = 4096  # of an exact power's numerator or denominator: ((10^64)^64)^64 is not an answer


class _Unparsed(ValueError):
    pass


def _latex_to_plain(text: str) -> str:
    text = text.replace("\\left", "").replace("\\right", "").replace("\\cdot", "*").replace("\\times", "*")
    text = text.replace("\\!", "").replace("\\,", "").replace("$", "").replace("\\%", "%")
    for _ in range(4):  # nested fractions, innermost first
        text = _FRAC.sub(r"((\1)/(\2))", text)
        text = _SQRT.sub(r"sqrt(\1)", text)
    return text.replace("\\pi", "pi").replace("{", "(").replace("}", ")")


def _tokens(text: str) -> list[str]:
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
            continue
        if m := _NUMBER.match(text, i):
            out.append(m.group().replace(",", ""))
            i = m.end()
        elif text.startswith("sqrt", i):
            out.append("sqrt")
            i += 4
        elif text.startswith("pi", i):
            out.append("pi")
            i += 2
        elif text.startswith("**", i):
            out.append("^")
            i += 2
        elif c in "+-*/^()%":
            out.append(c)
            i += 1
        else:
            raise _Unparsed(f"unexpected {c!r}")
    return out


class _Parser:
    """expr := term (('+'|'-') term)*;  term := unary (('*'|'/'|implicit) unary)*;
    unary := ('+'|'-') unary | power;  power := atom ('^' unary)?;  atom := number '%'? | pi | sqrt atom | '(' expr ')'"""

    def __init__(self, tokens: list[str]):
        self.t, self.i = tokens, 0

    def peek(self) -> str | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise _Unparsed("ends early")
        self.i += 1
        return tok

    def parse(self) -> sympy.Expr:
        value = self.expr()
        if self.peek() is not None:
            raise _Unparsed(f"trailing {self.peek()!r}")
        return value

    def expr(self) -> sympy.Expr:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> sympy.Expr:
        value = self.unary()
        while (tok := self.peek()) is not None and (tok in ("*", "/") or tok in ("(", "sqrt", "pi") or tok[0].isdigit()):
            if tok in ("*", "/"):
                self.take()
            right = self.unary()
            if tok == "/":
                if right == 0:
                    raise _Unparsed("division by zero")
                value = value / right
            else:
                value = value * right
        return value

    def unary(self) -> sympy.Expr:
        if self.peek() in ("+", "-"):
            return self.unary() if self.take() == "+" else -self.unary()
        return self.power()

    def power(self) -> sympy.Expr:
        base = self.atom()
        if self.peek() == "^":
            self.take()
            exponent = self.unary()
            if not exponent.is_number or abs(exponent) > _MAX_EXPONENT:
                raise _Unparsed("exponent too large")
            if base.is_Rational and max(int(base.p).bit_length(), int(base.q).bit_length()) * abs(exponent) > _MAX_BITS:
                raise _Unparsed("power too large")
            return base ** exponent
        return base

    def atom(self) -> sympy.Expr:
        tok = self.take()
        if tok == "(":
            value = self.expr()
            if self.take() != ")":
                raise _Unparsed("unbalanced parenthesis")
            return value
        if tok == "pi":
            return sympy.pi
        if tok == "sqrt":
            return sympy.sqrt(self.atom())
        if tok[0].isdigit() or tok[0] == ".":
            value = sympy.Rational(tok)
            if self.peek() == "%":
                self.take()
                value = value / 100
            return value
        raise _Unparsed(f"unexpected {tok!r}")


def parse_math(text: str) -> sympy.Expr | None:
    """The exact value of an answer (`7`, `-3.50`, `1,000`, `3/4`, `\\frac{3}{4}`, `2\\sqrt{2}`, `50%`), or
    None where it does not parse."""
    text = text.strip().rstrip(".").strip()
    if not text or len(text) > _MAX_CHARS:
        return None
    try:
        return _Parser(_tokens(_latex_to_plain(text))).parse()
    except (_Unparsed, ZeroDivisionError, ValueError, TypeError):
        return None


def _boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...}, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def _answers_in(text: str) -> list[str]:
    """The stretches of `text` that parse as answers, in order; a stretch that does not is read without
    what dangles at its end (`42 (` of "42 (forty-two)", `12 - ` of "12 - easy")."""
    found = []
    for m in _SPAN.finditer(text):
        span = m.group().strip().rstrip(".").strip()
        while span and not (re.search(r"\d|pi", span) and parse_math(span) is not None):
            shorter = span.rstrip("-+*/^( ")
            span = shorter if shorter != span else ""
        if span:
            found.append(span)
    return found


def final_answer(response: str) -> str | None:
    """The part of a response that states its final answer (see the module's docstring), or None."""
    if (boxed := _boxed(response)) is not None:
        return boxed
    markers = list(_MARKERS.finditer(response))
    if markers:  # the first answer after the last marker, on its line
        tail = response[markers[-1].end():].strip().splitlines()
        found = _answers_in(tail[0]) if tail else []
        return found[0] if found else None
    found = _answers_in(response)
    return found[-1] if found else None


def math_equal(prompt: str, response: str, answer: str | None) -> float:
    """1.0 where the response's final answer equals `answer` exactly (as numbers or simple expressions), else
    0.0; a reward rule (`reward.rule: alignflow.rewards:math_equal`)."""
    if answer is None:
        return 0.0
    expected, stated = parse_math(answer), final_answer(response)
    if expected is None or stated is None:
        return 0.0
    got = parse_math(stated)
    if got is None:
        return 0.0
    return 1.0 if sympy.simplify(got - expected) == 0 else 0.0


def math_correct(response: str, answer: str | None) -> bool:
    """Whether the response's final answer equals `answer` (math_equal), as an evaluation checker
    (`evaluation.checker: alignflow.rewards:math_correct`, with `vote_on: alignflow.rewards:final_answer`)."""
    return math_equal("", response, answer) == 1.0
