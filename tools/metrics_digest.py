"""Compare (or summarize) the metrics.jsonl files of tools/behaviour_snapshot.sh runs, timing fields aside.

    python tools/metrics_digest.py DIR           one line per run: its steps and a sha256 of its values
    python tools/metrics_digest.py BEFORE AFTER  exit 1 naming the first value that differs

Every value is compared exactly (floats by their repr). Left out: `perf/*` rates and times, and any key
ending in `_s` or `time` — they measure the machine, not the program.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path


def _timing(key: str) -> bool:
    return key.startswith("perf/") or key.endswith("_s") or key.endswith("time")


def runs(root: Path) -> dict[str, list[dict]]:
    out = {}
    for path in sorted(root.glob("*/metrics.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out[path.parent.name] = [{k: v for k, v in row.items() if not _timing(k)} for row in rows]
    return out


def digest(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]


def compare(before: dict, after: dict) -> list[str]:
    problems = [f"{name}: only in one snapshot" for name in sorted(set(before) ^ set(after))]
    for name in sorted(set(before) & set(after)):
        a, b = before[name], after[name]
        if len(a) != len(b):
            problems.append(f"{name}: {len(a)} vs {len(b)} logged steps")
            continue
        for i, (ra, rb) in enumerate(zip(a, b, strict=True)):
            for key in sorted(set(ra) | set(rb)):
                if ra.get(key) != rb.get(key):
                    problems.append(f"{name} row {i} {key}: {ra.get(key)!r} vs {rb.get(key)!r}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) == 1:
        for name, rows in runs(Path(argv[0])).items():
            print(f"{name}: {len(rows)} rows, {len({k for r in rows for k in r})} keys, sha256 {digest(rows)}")
        return 0
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    problems = compare(runs(Path(argv[0])), runs(Path(argv[1])))
    for line in problems[:20]:
        print(line)
    print("identical" if not problems else f"{len(problems)} differences")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
