"""Tool-call streaming: the cost of one streamed token once the reply is long.

    python bench/bench_tool_calls.py [--chars 100000] [--tokens 400] [--piece 4]

For each tool-call family (pyllama/server/tool_calls.py) a reply of about --chars characters is
built whose last call's arguments are still being written (the long case: a model writing a file
or a long document into a call), plus a reply of plain content. The first --chars characters go in
as one piece, then --tokens pieces of --piece characters each are timed. Two readers side by side:
`stream`, the server's ToolCallStream, and `reparse`, the whole reply so far parsed again at every
piece (what the stream did before it kept its reading state). Prints microseconds per token for
each and their ratio.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pyllama.server.tool_calls import (DS_CALL_BEGIN, DS_CALLS_BEGIN, DS_SEP, ToolCallStream,  # noqa: E402
                                       parse)


def long_args(n: int) -> str:
    """The start of an arguments object of about n characters (never closed)."""
    rows = []
    size, i = 0, 0
    while size < n:
        row = f'{{"line": {i}, "text": "row {i} of the \\"table\\", with \\\\ and \\u00e9", "ok": true}}'
        rows.append(row)
        size += len(row) + 2
        i += 1
    return '{"path": "out.txt", "rows": [' + ", ".join(rows)


REPLIES = {
    "hermes": lambda a: 'Writing it.\n<tool_call>\n{"name": "write", "arguments": ' + a,
    "llama3": lambda a: '{"name": "write", "parameters": ' + a,
    "mistral": lambda a: "[TOOL_CALLS]write[ARGS]" + a,
    "deepseek": lambda a: DS_CALLS_BEGIN + DS_CALL_BEGIN + "function" + DS_SEP + "write\n```json\n" + a,
    "generic": lambda a: '{"tool_calls": [{"name": "write", "arguments": ' + a,
}


def per_token_us(family: str, head: str, tail: str, piece: int, reparse: bool) -> float:
    pieces = [tail[k:k + piece] for k in range(0, len(tail), piece)]
    if reparse:
        text = head
        parse(family, text, final=False)
        t0 = time.perf_counter()
        for p in pieces:
            text += p
            parse(family, text, final=False)
    else:
        s = ToolCallStream(family)
        s.feed(head)
        t0 = time.perf_counter()
        for p in pieces:
            s.feed(p)
    return (time.perf_counter() - t0) / len(pieces) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chars", type=int, default=100_000, help="reply length before the timed tokens")
    ap.add_argument("--tokens", type=int, default=400, help="timed pieces")
    ap.add_argument("--piece", type=int, default=4, help="characters per piece (about one token)")
    args = ap.parse_args(argv)
    tail_len = args.tokens * args.piece
    print(f"us per token after {args.chars} characters ({args.tokens} pieces of {args.piece}):")
    print(f"{'reply':<22} {'stream':>9} {'reparse':>9} {'ratio':>7}")
    cases = [(f, f, build) for f, build in REPLIES.items()]
    cases.append(("content (hermes)", "hermes", lambda a: "plain words " * (len(a) // 12)))
    for label, family, build in cases:
        text = build(long_args(args.chars + tail_len + 200))
        head, tail = text[:args.chars], text[args.chars:args.chars + tail_len]
        stream = per_token_us(family, head, tail, args.piece, reparse=False)
        again = per_token_us(family, head, tail, args.piece, reparse=True)
        print(f"{label:<22} {stream:9.1f} {again:9.1f} {again / stream:6.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
