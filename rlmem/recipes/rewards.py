"""Rewards for ``rlmem train``: built-ins, or a user's function.

``reward=`` takes ``exact`` (the completion, stripped, equals the answer), ``math`` (the final answer of the
completion compared numerically with the answer, as GSM8K and MATH are scored: the last ``\\boxed{...}``,
else what follows ``####``, else the last number), or ``module:function`` / ``path/to/file.py:function``:
a function of ``(prompt, completion, answer)`` returning a number. A reward that raises, or returns
something that is not a finite number, stops the run with an error naming the row; it is never taken as 0.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["BUILTIN", "RewardFn", "exact_reward", "extract_answer", "load_reward", "math_reward", "score"]

RewardFn = Callable[[Any, str, Any], float]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces nested), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer a completion (or a GSM8K solution) states: the last ``\\boxed{}``, what follows the
    last ``####``, or the last number in the text; None if there is none."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _to_number(text: str) -> float | None:
    t = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    frac = re.fullmatch(r"\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", t)
    try:
        if frac:
            return float(frac.group(1)) / float(frac.group(2))
        if re.fullmatch(r"-?\d+/\d+", t):
            a, b = t.split("/")
            return float(a) / float(b)
        return float(t)
    except (ValueError, ZeroDivisionError):
        return None


def math_reward(prompt: Any, completion: str, answer: Any) -> float:
    """1.0 when the completion's final answer equals the reference numerically (or, for non-numbers, as
    text once spaces are removed), else 0.0. The reference may be a number or a GSM8K solution ending in
    ``#### 72``."""
    ref_text = str(answer)
    ref = extract_answer(ref_text) if ("####" in ref_text or "\\boxed" in ref_text) else ref_text.strip()
    got = extract_answer(completion)
    if got is None or ref is None:
        return 0.0
    a, b = _to_number(got), _to_number(ref)
    if a is not None and b is not None:
        return 1.0 if math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) else 0.0
    return 1.0 if re.sub(r"\s+", "", got) == re.sub(r"\s+", "", ref) else 0.0


def exact_reward(prompt: Any, completion: str, answer: Any) -> float:
    """1.0 when the completion, stripped, equals the answer as text."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


BUILTIN: dict[str, RewardFn] = {"exact": exact_reward, "math": math_reward}


def load_reward(spec: str) -> RewardFn:
    """The reward named by ``spec``: a built-in, ``module:function`` or ``path.py:function``.

    Raises:
        ValueError: an unknown name, a module or file that cannot be imported, or no such callable; one line.
    """
    if spec in BUILTIN:
        return BUILTIN[spec]
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(
            f"reward must be one of {', '.join(BUILTIN)}, sort_digits (the toy), module:function or "
            f"path.py:function; got {spec!r}"
        )
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ValueError(f"reward: file {where!r} does not exist")
            mod_spec = importlib.util.spec_from_file_location(f"rlmem_reward_{path.stem}", path)
            assert mod_spec is not None and mod_spec.loader is not None
            mod = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(where)
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"reward: could not import {where!r}: {type(e).__name__}: {e}") from e
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"reward: {where!r} has no function {name!r}")
    return fn


def score(
    fn: RewardFn,
    spec: str,
    prompts: Sequence[Any],
    completions: Sequence[str],
    answers: Sequence[Any],
    rows: Sequence[int],
) -> list[float]:
    """``fn`` on every (prompt, completion, answer).

    Raises:
        ValueError: the reward raised, or returned something that is not a finite number; naming the row.
    """
    out = []
    for p, c, a, row in zip(prompts, completions, answers, rows, strict=True):
        try:
            r = fn(p, c, a)
        except Exception as e:
            raise ValueError(f"reward {spec!r} raised on data row {row}: {type(e).__name__}: {e}") from e
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise ValueError(
                f"reward {spec!r} returned {r!r} on data row {row}; it must return a finite number"
            )
        out.append(float(r))
    return out
