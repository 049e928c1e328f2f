"""``auto_quantize(checkpoint=path)``: the scored search state in one JSON file, reloaded instead of re-scoring.

Written after scoring (atomically: a temporary file renamed over ``path``): the method, the candidate formats (name
and a digest of each config, and the fixed config's), and per group its layer names, choices, costs and raw
scores: everything the search needs, so a later call with another ``effective_bits`` re-solves without scoring.
Calibration is not stored: a call that loads the file calibrates only the formats its recipe picks (a few
forward passes; scoring is the expensive phase). The data are not compared: a checkpoint scored on other batches
is taken as it is, as ModelOpt's.

The file is untrusted input: it is plain JSON (parsed strictly, no NaN/Infinity), nothing in it is imported or
unpickled, and every entry is checked against the current search (method, formats and their configs, the fixed
config, group names, layer names, choices and costs: all must match exactly; scores must be finite numbers). Any
problem raises ValueError naming the file and the entry.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

FORMAT = "modelopt_lite.auto_quantize_search"
VERSION = 1
_TOP = {"format", "version", "method", "formats", "fixed", "groups"}
_GROUP = {"module_names", "formats", "costs", "fixed", "allow_no_quant", "raw_scores"}


def _bad(path, entry: str, why: str) -> ValueError:
    return ValueError(f"auto_quantize: checkpoint {path}: {entry}: {why}")


def _doc(method: str, formats: dict[str, str], fixed, stats: dict) -> dict:
    """The checkpoint document (``formats``: name -> config digest; ``fixed``: [name, digest] or None)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "method": method,
        "formats": dict(formats),
        "fixed": list(fixed) if fixed else None,
        "groups": {g: {k: s[k] for k in sorted(_GROUP)} for g, s in stats.items()},
    }


def save_checkpoint(path, method: str, formats: dict[str, str], fixed, stats: dict) -> None:
    """Write the scored search state (``stats`` with ``raw_scores``) to ``path``, atomically."""
    path = Path(path)
    text = json.dumps(_doc(method, formats, fixed, stats), indent=1, allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _no_constants(name: str):
    raise ValueError(f"the JSON literal {name} is not allowed")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def load_checkpoint(path, method: str, formats: dict[str, str], fixed, stats: dict) -> dict[str, list[float]]:
    """The raw scores per group of the checkpoint at ``path``, after checking it matches the current search."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _bad(path, "file", f"not UTF-8 text ({e})") from None
    except OSError as e:
        raise ValueError(f"auto_quantize: checkpoint {path} cannot be read ({e})") from None
    try:
        doc = json.loads(text, parse_constant=_no_constants)
    except ValueError as e:
        raise _bad(path, "file", f"not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise _bad(path, "file", f"must hold a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise _bad(
            path,
            "format",
            f"not a {FORMAT} v{VERSION} file (format {doc.get('format')!r}, version {doc.get('version')!r})",
        )
    if set(doc) != _TOP:
        raise _bad(path, "file", f"has keys {sorted(map(str, doc))}, expected {sorted(_TOP)}")
    expect = _doc(method, formats, fixed, {g: {**s, "raw_scores": None} for g, s in stats.items()})
    for key in ("method", "formats", "fixed"):
        if doc[key] != expect[key]:
            raise _bad(path, key, f"is {doc[key]!r}, this search has {expect[key]!r} (use another checkpoint path)")
    groups = doc["groups"]
    if not isinstance(groups, dict):
        raise _bad(path, "groups", f"must be an object, got {type(groups).__name__}")
    if list(groups) != list(stats):
        missing = [g for g in stats if g not in groups]
        extra = [g for g in groups if g not in stats]
        what = (
            f"lacks the group {missing[0]!r}"
            if missing
            else (
                f"has the group {extra[0]!r}, which this model/search does not"
                if extra
                else "lists the groups out of order"
            )
        )
        raise _bad(path, "groups", what)
    out = {}
    for g, s in stats.items():
        entry, rec = f"groups[{g!r}]", groups[g]
        if not isinstance(rec, dict) or set(rec) != _GROUP:
            got = sorted(map(str, rec)) if isinstance(rec, dict) else type(rec).__name__
            raise _bad(path, entry, f"must be an object with keys {sorted(_GROUP)}, got {got}")
        for k in ("module_names", "formats", "fixed", "allow_no_quant", "costs"):
            if rec[k] != s[k] or type(rec[k]) is not type(s[k]):
                raise _bad(path, f"{entry}.{k}", f"is {rec[k]!r}, the current search has {s[k]!r}")
        raw = rec["raw_scores"]
        if not isinstance(raw, list) or len(raw) != len(s["formats"]):
            raise _bad(path, f"{entry}.raw_scores", f"must be a list of {len(s['formats'])} numbers, got {raw!r}")
        for i, v in enumerate(raw):
            if not _is_number(v):
                raise _bad(path, f"{entry}.raw_scores[{i}]", f"must be a finite number, got {v!r}")
        out[g] = [float(v) for v in raw]
    return out
