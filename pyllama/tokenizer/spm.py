"""SentencePiece-style tokenizer (`tokenizer.ggml.model == 'llama'`), llama.cpp's algorithm:
characters are merged pairwise, best-scoring vocabulary pair first, then unknown pieces fall back
to `<0xXX>` byte tokens."""
from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import Any

from .base import Tokenizer

SPACE = "\u2581"  # '▁', SentencePiece's visible space


class SPMTokenizer(Tokenizer):
    """llama.cpp's `llm_tokenizer_spm`."""

    model = "llama"
    _default_ids = {"bos_id": 1, "eos_id": 2, "unk_id": 0}
    _default_add_bos = True
    _default_add_space_prefix = True

    def __init__(self, metadata: dict[str, Any], source: str = "model"):
        super().__init__(metadata, source)
        self._neg_scores = [-s for s in self._scores]  # heapq is a min-heap
        self._byte_ids = [self._byte_token(b) for b in range(256)]

    def _byte_token(self, b: int) -> int | None:
        tid = self._token_to_id.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = self._token_to_id.get(chr(b))
        # llama.cpp throws here; a vocabulary without byte tokens gets <unk> instead
        return tid if tid is not None else self.unk_id

    def _normal_piece(self, text: str) -> bytes:
        return text.replace(SPACE, " ").encode("utf-8")

    def _byte_piece(self, token_id: int) -> bytes:
        t = self._texts[token_id]
        try:
            return bytes([int(t[3:5], 16)])  # "<0xXX>"
        except ValueError:
            return b""

    def _encode_text(self, text: str, prev_special: bool, out: list[int]) -> None:
        if self.add_space_prefix and prev_special:
            text = " " + text
        text = text.replace(" ", SPACE)
        n = len(text)
        if n == 0:
            return
        get = self._token_to_id.get
        neg = self._neg_scores
        # Symbol i starts at character i and covers ln[i] characters; a merge grows the left
        # symbol over the right one, so a symbol's text is always text[i:i + ln[i]].
        ln = [1] * n
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            tid = get(text[i:i + 2])
            if tid is not None:
                heap.append((neg[tid], i, i + 1, 2))
        heapify(heap)
        # best score first, ties to the leftmost pair (llama.cpp's llm_bigram_spm comparator)
        while heap:
            _, left, right, size = heappop(heap)
            ll = ln[left]
            rl = ln[right]
            if ll == 0 or rl == 0 or ll + rl != size:
                continue  # stale: one side was merged since this pair was queued
            ln[left] = size
            ln[right] = 0
            r2 = nxt[right]
            nxt[left] = r2
            if r2 != -1:
                prv[r2] = left
                m = size + ln[r2]
                tid = get(text[left:left + m])
                if tid is not None:
                    heappush(heap, (neg[tid], left, r2, m))
            p = prv[left]
            if p != -1:
                m = ln[p] + size
                tid = get(text[p:p + m])
                if tid is not None:
                    heappush(heap, (neg[tid], p, left, m))
        # Every merged symbol is in the vocabulary, so llama.cpp's rev_merge re-segmentation
        # never applies; only unmerged characters missing from it fall back to bytes.
        byte_ids = self._byte_ids
        i = 0
        while i != -1:
            s = text[i:i + ln[i]]
            tid = get(s)
            if tid is not None:
                out.append(tid)
            else:
                for b in s.encode("utf-8"):
                    bid = byte_ids[b]
                    if bid is not None:
                        out.append(bid)
            i = nxt[i]
