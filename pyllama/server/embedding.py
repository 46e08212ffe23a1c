"""Embeddings as llama-server computes them: the final hidden state after the output norm
(`result_norm`) of a prompt's tokens, pooled per sequence and normalized, all on the host.

Pooling: none (one vector per token), mean (their average), cls (the first token's), last (the
last token's), rank (the first token's through a reranker's classification head: its scores). A model's default is its GGUF key `<arch>.pooling_type`, else none, as llama.cpp.
"""
from __future__ import annotations

import base64
from typing import Any, Optional

import numpy as np

from ..batching.pooling import pool, rows_wanted  # noqa: F401 - the handlers pool through this module
from ..util.errors import PyllamaError

POOLING_NAMES = ("none", "mean", "cls", "last", "rank")  # index = llama.cpp's llama_pooling_type value


def model_pooling(gguf: Any, option: Optional[str], rank_head: bool = False) -> str:
    """The pooling a server uses: --pooling, else the model's `<arch>.pooling_type`, else none.
    rank_head: whether the model has a reranker's head (without one rank means nothing)."""
    if option:
        return option
    arch = gguf.get("general.architecture", "")
    value = gguf.get(f"{arch}.pooling_type", 0)
    if isinstance(value, int) and 0 <= value < len(POOLING_NAMES) and (value != 4 or rank_head):
        return POOLING_NAMES[value]
    return "none"


def check_rank_pooling(pooling: str, model_name: str, rank_head: bool) -> None:
    """One line refusing rank pooling (--rerank, --pooling rank) for a model without a reranker's head."""
    if pooling == "rank" and not rank_head:
        raise PyllamaError(f"{model_name}: rank pooling (--rerank, --pooling rank) needs a reranker: a bert or "
                           "jina-bert-v2 model with a classification head (cls.weight or cls.output.weight), which "
                           "this model lacks")


def rerank_tokens(tok: Any, metadata: Any, query: str, doc: str) -> list[int]:
    """A query and a document as one sequence, as llama-server frames them: the file's rerank
    template (`tokenizer.chat_template.rerank`, {query} and {document} replaced) where it has one,
    else [BOS] query [EOS] [SEP] document [EOS], each marker where the vocabulary adds it (EOS
    falls back to SEP; WordPiece adds SEP and, unless the file says so, no BOS)."""
    template = metadata.get("tokenizer.chat_template.rerank")
    if isinstance(template, str):
        text = template.replace("{query}", query).replace("{document}", doc)
        return tok.encode(text, add_special=False, parse_special=True)
    wpm = metadata.get("tokenizer.ggml.model") == "bert"
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) if wpm else tok.add_bos
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) if wpm else tok.add_eos
    add_sep = metadata.get("tokenizer.ggml.add_sep_token",
                           wpm or metadata.get("tokenizer.ggml.pre") in ("jina-v1-en", "jina-v2-code", "roberta-bpe"))
    eos = tok.eos_id if tok.eos_id is not None else tok.sep_id
    out: list[int] = [tok.bos_id] if add_bos and tok.bos_id is not None else []
    out += tok.encode(query, add_special=False)
    if add_eos and eos is not None:
        out.append(eos)
    if add_sep and tok.sep_id is not None:
        out.append(tok.sep_id)
    out += tok.encode(doc, add_special=False)
    if add_eos and eos is not None:
        out.append(eos)
    return out


def rerank_response(body: dict, model: str, scores: list[tuple[float, int]], documents: list[str],
                    top_n: int) -> Any:
    """llama-server's /rerank body for [(score, tokens)] in document order: Jina's form (`results`
    of `index` and `relevance_score`, with `model`, `object`, `usage`), or TEI's (a list of `index`
    and `score`, with `text` when `return_text`) for a request that gives `texts`; best first, at
    most top_n."""
    tei = "texts" in body
    label = "score" if tei else "relevance_score"
    items = []
    for i, (score, _) in enumerate(scores):
        item: dict = {"index": i, label: score}
        if tei and body.get("return_text", False) is True:
            item["text"] = documents[i]
        items.append(item)
    items.sort(key=lambda it: -it[label])  # stable: equal scores keep document order
    items = items[:top_n]
    if tei:
        return items
    n_tokens = sum(n for _, n in scores)
    return {"model": model, "object": "list", "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            "results": items}


def normalize(v: np.ndarray, embd_normalize: int) -> np.ndarray:
    """llama.cpp's common_embd_normalize: -1 none, 0 max-abs scaled to the int16 range (32760),
    2 Euclidean, any other p > 0 the p-norm. A zero vector stays zero."""
    x = v.astype(np.float64)
    if embd_normalize == -1:
        total = 1.0
    elif embd_normalize == 0:
        total = float(np.abs(x).max(initial=0.0)) / 32760.0
    elif embd_normalize == 2:
        total = float(np.sqrt((x * x).sum()))
    else:
        total = float((np.abs(x) ** embd_normalize).sum() ** (1.0 / embd_normalize))
    scale = 1.0 / total if total > 0 else 0.0
    return (x * scale).astype(np.float32)


def native_item(index: int, vectors: np.ndarray) -> dict:
    """/embedding's element: `embedding` is a list of vectors (one per token for pooling none, else
    the one pooled vector)."""
    rows = vectors if vectors.ndim == 2 else vectors[None, :]
    return {"index": index, "embedding": rows.tolist()}


def oai_response(model: str, items: list[tuple[np.ndarray, int]], use_base64: bool) -> dict:
    """/v1/embeddings' body for pooled vectors [(vector, n_prompt_tokens)], in input order."""
    data = []
    for i, (vec, _) in enumerate(items):
        if use_base64:  # little-endian float32 bytes, as llama-server sends them
            data.append({"embedding": base64.b64encode(vec.astype("<f4").tobytes()).decode(), "index": i,
                         "object": "embedding", "encoding_format": "base64"})
        else:
            data.append({"embedding": vec.tolist(), "index": i, "object": "embedding"})
    n_tokens = sum(n for _, n in items)
    return {"model": model, "object": "list", "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            "data": data}
