"""A tiny llama-architecture GGUF model that needs no download.

It exists so that the gateway, its tests and the demo can start real ``llama-server`` workers on any
machine, offline. The weights are random: the text it writes is gibberish, but every code path of
llama-server (tokenizer, chat template, KV cache, slots, streaming, metrics) runs for real.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gateway.logs import get_logger
from workers.provision import cache_root

log = get_logger(__name__)

DEMO_MODEL_SPEC = """\
demo.gguf: llama architecture (general.architecture = "llama", general.name = "demo"), f32 weights.
  - n_embd 64, 2 layers, 4 attention heads, 4 KV heads (head dim 16, rope over all 16 dims),
    n_ff 128, RMS-norm eps 1e-5, rope freq base 10000, context_length = n_ctx_train (default 4096).
  - Random weights drawn from N(0, 0.02) with numpy's seeded default_rng (norm weights are 1),
    except embedding dimension 0, a text/control flag (+1 / -1; see CONTROL_FLAG_DIM): after a
    text token the model practically never emits a control token (so EOS never cuts a long
    generation short), and after <|im_end|> it emits one at once (a deterministic EOS stop);
    the output projection is tied to the token embedding (no output.weight tensor).
  - Byte-level BPE tokenizer (tokenizer.ggml.model = "gpt2", tokenizer.ggml.pre = "default"):
    the 256 byte tokens in GPT-2 byte-to-unicode form, then N_MERGES merged tokens learned
    deterministically from a small built-in English word list (merges are never empty; every merge
    result is in the vocabulary), then three CONTROL tokens:
    <|endoftext|> (bos), <|im_start|>, <|im_end|> (eos, end of generation).
  - add_bos_token = false, add_eos_token = false; a ChatML tokenizer.chat_template
    (<|im_start|>role\\ncontent<|im_end|>\\n ..., add_generation_prompt appends <|im_start|>assistant\\n).
  - About 0.5 MB on disk.
"""

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 4
N_FF = 128
N_MERGES = 300
WEIGHT_STD = 0.02
N_CTX_TRAIN = 4096  # the demo model's context_length (tokens) unless written with another


@dataclass(frozen=True)
class ModelShape:
    """The transformer's sizes (tokens of width, layers, heads) and its weights' storage type.

    ``dtype`` is the storage of the 2-D weight matrices of the layers: ``"f32"``, ``"f16"``, or
    ``"q4_0"`` / ``"q8_0"`` (quantized by the ``gguf`` package; rows must be a multiple of 32
    wide). Norms stay f32; the token embedding is f32 or f16. The vocabulary, tokenizer and
    chat template are the demo model's whatever the shape.
    """

    n_embd: int = N_EMBD
    n_layer: int = N_LAYER
    n_head: int = N_HEAD
    n_head_kv: int = N_HEAD_KV
    n_ff: int = N_FF
    dtype: str = "f32"

    def parameters(self) -> int:
        """Weights in the layers (embedding excluded), e.g. 0.97e9 for ``GPU_BENCH_SHAPE``."""
        kv = self.n_embd // self.n_head * self.n_head_kv
        per_layer = (2 * self.n_embd * self.n_embd + 2 * kv * self.n_embd
                     + 3 * self.n_ff * self.n_embd)
        return self.n_layer * per_layer


DEMO_SHAPE = ModelShape()

GPU_BENCH_SHAPE = ModelShape(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192,
                             dtype="f16")
"""Llama-3.2-1B's layer sizes (its config.json: hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192), f16, with the demo vocabulary: about 1.9 GB, for benchmarks on a GPU, where
the demo model's compute is too small to matter (written by ``tests/bench/real_gpu.py``)."""

LLAMA8B_Q4_SHAPE = ModelShape(n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336,
                              dtype="q4_0")
"""Llama-3.1-8B's layer sizes (its config.json: hidden 4096, 32 layers, 32 heads, 8 KV heads,
intermediate 14336), Q4_0, with the demo vocabulary (so no 128k-token output layer): about
3.9 GB, the model of the simulator's published-figure profiles ("Llama 8B Q4_0"), for
calibrating a GPU (``tests/bench/real_gpu.py``)."""

_QUANTIZED = {"q4_0": "Q4_0", "q8_0": "Q8_0"}  # ModelShape.dtype -> gguf.GGMLQuantizationType

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A small, fixed English corpus for learning merges. Changing it changes the vocabulary (and so the
# model file); keep it stable.
_CORPUS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an each
she which do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very through
just form sentence great think say help low line differ turn cause much mean before move right boy
old too same tell does set three want air well also play small end put home read hand port large
spell add even land here must big high such follow act why ask men change went light kind off need
house picture try us again animal point mother world near build self earth father head stand own
page should country found answer school grow study still learn plant cover food sun four between
state keep eye never last let thought city tree cross farm hard start might story saw far sea draw
left late run don't while press close night real life few north open seem together next white
children begin got walk example ease paper group always music those both mark often letter until
mile river car feet care second book carry took science eat room friend began idea fish mountain
stop once base hear horse cut sure watch color face wood main enough plain girl usual young ready
above ever red list though feel talk bird soon body dog family direct pose leave song measure door
product black short numeral class wind question happen complete ship area half rock order fire south
problem piece told knew pass since top whole king space heard best hour better true during hundred
five remember step early hold west ground interest reach fast verb sing listen six table travel less
morning ten simple several vowel toward war lay against pattern slow center love person money serve
appear road map rain rule govern pull cold notice voice unit power town fine certain fly fall lead
cry dark machine note wait plan figure star box noun field rest correct able pound done beauty drive
stood contain front teach week final gave green oh quick develop ocean warm free minute strong
special mind behind clear tail produce fact street inch multiply nothing course stay wheel full force
blue object decide surface deep moon island foot system busy test record boat common gold possible
plane stead dry wonder laugh thousand ago ran check game shape equate hot miss brought heat snow tire
bring yes distant fill east paint language among hello assistant user system model token server
request response stream slot gateway worker
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _learn_merges(n_merges: int) -> list[tuple[str, str]]:
    """Learn ``n_merges`` BPE merges from the built-in corpus, deterministically.

    Words are pre-tokenized GPT-2 style (a leading space belongs to the word), mapped to the
    byte-to-unicode alphabet, and the most frequent adjacent pair is merged repeatedly (ties broken
    lexicographically).
    """
    b2u = _bytes_to_unicode()
    words = Counter(" " + w for w in _CORPUS.split())
    seqs: dict[tuple[str, ...], int] = {}
    for w, c in words.items():
        key = tuple(b2u[b] for b in w.encode("utf-8"))
        seqs[key] = seqs.get(key, 0) + c
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for seq, c in seqs.items():
            for a, b in zip(seq, seq[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best_count = max(pairs.values())
        best = min(p for p, c in pairs.items() if c == best_count)
        merges.append(best)
        merged = best[0] + best[1]
        new_seqs: dict[tuple[str, ...], int] = {}
        for seq, c in seqs.items():
            out: list[str] = []
            i = 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            key = tuple(out)
            new_seqs[key] = new_seqs.get(key, 0) + c
        seqs = new_seqs
    return merges


def build_vocab() -> tuple[list[str], list[int], list[str], dict[str, int]]:
    """Return (tokens, token_types, merges as "a b" strings, special token ids)."""
    from gguf import TokenType

    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    types = [int(TokenType.NORMAL)] * 256
    seen = set(tokens)
    merges = []
    for a, b in _learn_merges(N_MERGES):
        merges.append(f"{a} {b}")
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
            types.append(int(TokenType.NORMAL))
    special: dict[str, int] = {}
    for s in SPECIAL_TOKENS:
        special[s] = len(tokens)
        tokens.append(s)
        types.append(int(TokenType.CONTROL))
    return tokens, types, merges, special


def demo_model_path() -> Path:
    """Where the gateway keeps its demo model: ``cache_root()/models/demo.gguf``."""
    return cache_root() / "models" / "demo.gguf"


def write_demo_model(path: Path, *, seed: int = 0, n_ctx_train: int = N_CTX_TRAIN,
                     shape: ModelShape = DEMO_SHAPE) -> Path:
    """Write the demo model (see ``DEMO_MODEL_SPEC``) to ``path`` atomically and return ``path``.

    ``shape`` other than :data:`DEMO_SHAPE` writes a bigger model of the same kind (same
    vocabulary, template and control-token flag; ``general.name`` "demo-<n_embd>x<n_layer>"), whose layers
    share one draw of random weights: a forward pass costs the same whatever the values, and
    fresh numbers for 8B weights would take minutes to draw. Raises ``ValueError`` for a shape
    whose heads do not divide ``n_embd``, an unknown ``dtype``, or quantized rows not a
    multiple of 32.
    """
    import gguf

    if (shape.n_embd % shape.n_head or shape.n_head % shape.n_head_kv
            or shape.dtype not in ("f32", "f16", *_QUANTIZED)
            or (shape.dtype in _QUANTIZED and (shape.n_embd % 32 or shape.n_ff % 32))):
        raise ValueError(f"unusable model shape {shape}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, types, merges, special = build_vocab()
    n_vocab = len(tokens)
    n_embd, n_head, n_head_kv, n_ff = shape.n_embd, shape.n_head, shape.n_head_kv, shape.n_ff
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)
    wtype = np.float32 if shape.dtype == "f32" else np.float16
    qtype = (getattr(gguf.GGMLQuantizationType, _QUANTIZED[shape.dtype])
             if shape.dtype in _QUANTIZED else None)

    # float64 draws keep the demo model's bytes as they always were; a big shape draws float32
    # (about twice as fast: a 1B shape takes seconds)
    draw = np.float64 if shape == DEMO_SHAPE else np.float32

    def rand(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=draw) * WEIGHT_STD).astype(wtype)

    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        w = gguf.GGUFWriter(str(tmp), arch="llama")
        w.add_name("demo" if shape == DEMO_SHAPE else f"demo-{n_embd}x{shape.n_layer}")
        w.add_description("llama-gateway demo model: random weights, offline, for tests and demos")
        w.add_file_type(int(gguf.LlamaFileType.ALL_F32 if shape.dtype == "f32" else
                            getattr(gguf.LlamaFileType, "MOSTLY_" + shape.dtype.upper())))
        w.add_vocab_size(n_vocab)
        w.add_context_length(n_ctx_train)
        w.add_embedding_length(n_embd)
        w.add_block_count(shape.n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)

        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(special["<|endoftext|>"])
        w.add_eos_token_id(special["<|im_end|>"])
        w.add_add_bos_token(False)
        w.add_add_eos_token(False)
        w.add_chat_template(CHATML_TEMPLATE)

        # numpy shapes are the reverse of ggml's ne order (e.g. token_embd is ne = [n_embd, n_vocab]).
        w.add_tensor("token_embd.weight", _embeddings(rand(n_vocab, n_embd), special.values()))
        w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
        dims = {"attn_q": (n_head * head_dim, n_embd), "attn_k": (n_head_kv * head_dim, n_embd),
                "attn_v": (n_head_kv * head_dim, n_embd), "attn_output": (n_embd, n_head * head_dim),
                "ffn_gate": (n_ff, n_embd), "ffn_up": (n_ff, n_embd), "ffn_down": (n_embd, n_ff)}
        shared: dict[str, np.ndarray] = {}
        for i in range(shape.n_layer):
            p = f"blk.{i}."
            w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
            for name, (rows, cols) in dims.items():
                if name == "ffn_gate":
                    w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
                if shape == DEMO_SHAPE:  # the demo's own draws, in its order, as always
                    w.add_tensor(p + name + ".weight", rand(rows, cols))
                    continue
                if name not in shared:
                    m = rand(rows, cols)
                    shared[name] = m if qtype is None else gguf.quants.quantize(
                        m.astype(np.float32), qtype)
                w.add_tensor(p + name + ".weight", shared[name], raw_dtype=qtype)

        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the model is not secret
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info(
        "demo_model.written",
        path=str(path),
        bytes=path.stat().st_size,
        n_vocab=n_vocab,
        n_merges=len(merges),
        n_ctx_train=n_ctx_train,
        seed=seed,
    )
    return path


# Dimension 0 of every embedding is a "text vs control" flag: +1 for text tokens, -1 for the
# control tokens. The output layer is tied to the embedding, so after RMS norm the next-token
# logits of control tokens sit about 16 below those of text tokens when the last token is text
# (generation practically never hits EOS and runs to num_predict, which long-request tests
# need), and far above them when the last token is a control token (a raw prompt ending in
# <|im_end|> stops at once with stop_type "eos", which done_reason tests need).
CONTROL_FLAG_DIM = 0


def _embeddings(emb: np.ndarray, control_ids) -> np.ndarray:
    emb[:, CONTROL_FLAG_DIM] = 1.0
    for i in control_ids:
        emb[i, CONTROL_FLAG_DIM] = -1.0
    return emb


def ensure_demo_model(path: Path | None = None) -> Path:
    """Return the demo model's path, writing it first if it is missing."""
    path = Path(path) if path is not None else demo_model_path()
    if not path.exists():
        write_demo_model(path)
    return path
