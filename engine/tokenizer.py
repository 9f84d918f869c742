"""Tokenizer: encode / decode / chat templates over a `tokenizers.Tokenizer`, plus GGUF builders."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from engine.config import ModelError

# The template transformers falls back to for ChatML models; used when a model ships none.
GIL_FREE_ENCODE_CHARS = 20_000

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Control tokens llama.cpp treats as end-of-generation besides the declared eos/eot/eom ids.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
)


class Tokenizer:
    """Text <-> token ids and chat-template rendering for one model."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > GIL_FREE_ENCODE_CHARS:
            # tokenizers' encode() holds the GIL throughout (6 s for a 4 MB prompt, every other
            # thread of the process stopped); encode_batch releases it.
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its longest vocabulary entry; a
        byte-level entry has a character per byte, and a byte decodes to at most one
        character): a text longer than this times N has more than N tokens."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs,
    ) -> str:
        """Render `messages` ([{"role", "content"}, ...]) the way transformers does; `chat_template`
        replaces the model's own (as transformers' argument of that name), and other keywords
        (`tools`, ...) are the template's variables."""
        if chat_template is not None:
            template = _compile_cached(chat_template)
        else:
            if self._template is None:
                self._template = _compile_template(self.chat_template)
            template = self._template
        try:
            return template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as exc:
            raise ModelError(f"The model's chat template failed on these messages: {exc}") from exc

    def save(self, folder: str | Path) -> Path:
        """Write tokenizer.json and a tokenizer_config.json (template, bos, eos) into `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        config = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "chat_template": self.chat_template,
        }
        text = json.dumps(config, indent=2, ensure_ascii=False)
        (folder / "tokenizer_config.json").write_text(text, encoding="utf-8")
        return folder / "tokenizer.json"


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, indent: int | None = None, **_: object) -> str:
    # transformers' variant keeps non-ASCII text readable instead of \u-escaping it.
    return json.dumps(value, indent=indent, ensure_ascii=False)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _compile_template(source: str):
    try:
        return _environment().from_string(source)
    except TemplateError as exc:
        raise ModelError(f"The model's chat template does not parse: {exc}") from exc


# A server's --chat-template is compiled once, not per request.
_compile_cached = functools.lru_cache(maxsize=8)(_compile_template)


def template_variables(source: str) -> set[str]:
    """The variables a chat template reads from its caller (`messages`, `tools`, ...)."""
    try:
        return meta.find_undeclared_variables(_environment().parse(source))
    except TemplateError as exc:
        raise ModelError(f"The chat template does not parse: {exc}") from exc


# --- building a tokenizer from GGUF metadata (llama.cpp's vocabulary description) ---

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's `tokenizer.ggml.pre` names -> (split regex or None for GPT-2's, isolate digits).
# These follow llama.cpp's llama-vocab.cpp; e.g. "smollm" is `\p{N}` then the GPT-2 regex,
# which is exactly SmolLM2's original Digits(individual_digits=True) + ByteLevel pre-tokenizer.
_DIGIT_FIRST = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_PRE_SPLITS = {
    **{name: (None, True) for name in _DIGIT_FIRST},
    **{name: (None, False) for name in ("default", "gpt2", "mpt", "olmo", "jais")},
    **{
        name: (_LLAMA3_SPLIT, False)
        for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral")
    },
    **{name: (_QWEN2_SPLIT, False) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2")},
}
_CONTROL, _USER_DEFINED = 3, 4


def byte_level_bpe(
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int],
    pre: str | None,
    add_bos_token: bool = False,
    bos_token_id: int | None = None,
) -> Backend:
    """A GPT-2 style byte-level BPE backend from GGUF `tokenizer.ggml.*` arrays."""
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
    split, digits_first = _PRE_SPLITS.get(pre or "default", (None, False))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits_first else []
    if split is None:
        # ByteLevel's own regex is the GPT-2 one; using it keeps the pipeline identical to
        # the original tokenizer.json of such models.
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    if split is _QWEN2_SPLIT:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    _add_special(backend, tokens, token_types)
    _set_bos_processor(backend, tokens, bos_token_id if add_bos_token else None)
    return backend


def sentencepiece_bpe(
    tokens: Sequence[str],
    scores: Sequence[float],
    token_types: Sequence[int],
    add_space_prefix: bool = True,
    add_bos_token: bool = True,
    bos_token_id: int | None = None,
    unk_token_id: int | None = 0,
) -> Backend:
    """A Llama/Mistral sentencepiece BPE backend (byte fallback) from GGUF arrays."""
    vocab = {token: index for index, token in enumerate(tokens)}
    unk = tokens[unk_token_id] if unk_token_id is not None else None
    model = models.BPE(
        vocab=vocab,
        merges=_merges_from_scores(tokens, scores),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = Backend(model)
    replace = [normalizers.Replace(" ", "\u2581")]
    prefix = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence(prefix + replace)
    strip = [decoders.Strip(content=" ", left=1, right=0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    _add_special(backend, tokens, token_types)
    _set_bos_processor(backend, tokens, bos_token_id if add_bos_token else None)
    return backend


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    # Sentencepiece BPE ranks a merge by the score of the token it produces (higher first);
    # this is the same reconstruction transformers' SentencePieceExtractor performs.
    vocab = {token: index for index, token in enumerate(tokens)}
    found = []
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[index], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _add_special(backend: Backend, tokens: Sequence[str], token_types: Sequence[int]) -> None:
    # Control tokens (<|im_start|>) are special; user-defined ones (<think>) are matched whole
    # but are ordinary text when decoding, as in llama.cpp.
    control = [tokens[i] for i, kind in enumerate(token_types) if kind == _CONTROL]
    user = [tokens[i] for i, kind in enumerate(token_types) if kind == _USER_DEFINED]
    if control:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _set_bos_processor(backend: Backend, tokens: Sequence[str], bos_id: int | None) -> None:
    if bos_id is None:
        return
    bos = tokens[bos_id]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )


def end_of_turn_ids(
    tokens: Sequence[str], token_types: Sequence[int], declared: Iterable[int | None]
) -> tuple[int, ...]:
    """The declared eos/eot ids first, then control tokens llama.cpp also stops on."""
    ids = [int(i) for i in declared if i is not None]
    index = {token: i for i, token in enumerate(tokens)}
    for text in END_OF_TURN_TOKENS:
        i = index.get(text)
        if i is not None and token_types and token_types[i] == _CONTROL:
            ids.append(i)
    return tuple(dict.fromkeys(ids))
