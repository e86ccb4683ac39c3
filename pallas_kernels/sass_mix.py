"""Instruction mix of dumped Mosaic GPU kernels: ``MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO=DIR`` makes
Mosaic GPU write each compiled kernel's SASS under DIR; this prints, per file, the static instruction count
by opcode (``python -m pallas_kernels.sass_mix DIR``). Static counts are per kernel, not per element:
read them against the loop body (the instructions between the innermost loop's label and its branch).
"""

from __future__ import annotations

import collections
import os
import re
import sys

_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?")


def opcodes(text: str) -> collections.Counter:
    """Opcode (with its modifiers) -> count over the SASS listing."""
    return collections.Counter(m.group(1) + (m.group(2) or "") for m in _INSTR.finditer(text))


def main(directory: str) -> None:
    for root, _, files in os.walk(directory):
        for name in sorted(files):
            path = os.path.join(root, name)
            with open(path, errors="replace") as f:
                text = f.read()
            mix = opcodes(text)
            if not mix:
                continue
            base = collections.Counter()
            for op, n in mix.items():
                base[op.split(".")[0]] += n
            print(f"== {path}: {sum(mix.values())} instructions")
            print("   by opcode:", dict(base.most_common(30)))
            print("   with modifiers:", dict(mix.most_common(40)))


if __name__ == "__main__":
    main(sys.argv[1])
