"""The embedded model's chat template: ChatML turns, tool calls as ``<tool_call>{json}</tool_call>``.

Engines render a chat request with the template in the model folder's ``tokenizer_config.json`` and
parse tool calls out of the answer with their own parser. This template writes tool calls in the
format vLLM's and SGLang's ``hermes`` parser reads (``--tool-call-parser hermes``), the format Qwen2.5
and Qwen3 use, so the embedded model and a real Qwen3 go through the same chat path::

    <|im_start|>system
    You are a coding agent ...
    # Tools
    ... one JSON tool signature per line ...<|im_end|>
    <|im_start|>user
    List the files.<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": "bash", "arguments": {"command": "ls"}}
    </tool_call><|im_end|>
    <|im_start|>tool
    a.py<|im_end|>
    <|im_start|>assistant

An assistant turn ends with ``<|im_end|>``, which the engine stops at (it is written into the model's
``generation_config.json`` as an end-of-sequence id) and which is part of the turn's output ids, so
the next turn's prompt starts with exactly the previous prompt and output (see
:mod:`training.capture_rollouts` for what happens when it does not).

    from serving.chat_template import install_chat_template
    install_chat_template(model_dir)     # tokenizer_config.json, chat_template.jinja, generation_config.json

**Text is encoded as text.** A Hugging Face tokenizer turns the string of a special token into its
id wherever the string occurs, in a message's content as in the template's own markers (even with
``add_special_tokens=False``). What an agent's commands print comes back as a tool result or an
observation, so a policy could forge a turn (``<|im_end|>`` then ``<|im_start|>system``) or end the
context by printing the strings. Prompts are therefore encoded here, never by the engine from text:
:func:`render_chat` renders a chat with the model's template and encodes the template's markers as
their ids and everything the messages and tools carry as text (special tokens split into ordinary
tokens; decoding shows the same characters); :class:`TemplateText` does the same for any template
(the harness's prompt formats, :mod:`evals.harness`), and :func:`encode_text` encodes text that no
template wrote. For text without special-token strings the ids are exactly the tokenizer's own.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
DEFAULT_SYSTEM = "You are a coding agent working in a git repository."

# Whitespace control is explicit ({%- -%}) so that the rendered text is exactly the layout above.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='" + DEFAULT_SYSTEM + "', start=0) -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.system = messages[0]['content'] -%}{%- set ns.start = 1 -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>system\\n' + ns.system -}}"
    "{%- if tools -%}"
    "{{- '\\n\\n# Tools\\n\\nTo call a tool, answer with <tool_call>\\n"
    "{\"name\": <tool name>, \"arguments\": <arguments as a JSON object>}\\n</tool_call>"
    " (one block per call). The tools:' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for message in messages[ns.start:] -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message['content'] -%}{{- message['content'] -}}{%- endif -%}"
    "{%- for call in (message['tool_calls'] or []) -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' -}}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class ChatTemplateError(ValueError):
    """A model folder the chat template cannot be installed into (the message names the file)."""


def install_chat_template(model_dir: str | Path) -> Path:
    """Make ``model_dir``'s tokenizer render chats with :data:`CHAT_TEMPLATE` and its engine stop at
    the end of an assistant turn; returns ``model_dir``.

    Writes ``chat_template`` into ``tokenizer_config.json`` and ``chat_template.jinja`` (transformers
    5 reads the latter first), and adds ``<|im_end|>``'s id to ``eos_token_id`` in
    ``generation_config.json``. The tokenizer must have ``<|im_start|>`` and ``<|im_end|>`` as single
    tokens (build it with them as special tokens), else the model could not end a turn in one token.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ChatTemplateError(f"{config_path}: not found (is {model_dir} a saved model folder?)") from None
    except ValueError as exc:
        raise ChatTemplateError(f"{config_path}: not valid JSON: {exc}") from None
    # heavy: transformers (and torch through it)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = {}
    for marker in (TURN_START, TURN_END):
        encoded = tokenizer.encode(marker, add_special_tokens=False)
        if len(encoded) != 1:
            raise ChatTemplateError(
                f"{model_dir}: the tokenizer encodes {marker!r} as {len(encoded)} tokens; it must be one token "
                "(add it to the tokenizer's special tokens before training the model)")
        if encoded[0] not in special_token_ids(tokenizer):
            raise ChatTemplateError(
                f"{model_dir}: {marker!r} is an added token but not a special one; it must be special, else a "
                "message that contains the string could not be encoded as text (see encode_text)")
        ids[marker] = encoded[0]
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (model_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    eos = gen.get("eos_token_id", tokenizer.eos_token_id)
    eos_ids = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    if ids[TURN_END] not in eos_ids:
        eos_ids.append(ids[TURN_END])
    gen["eos_token_id"] = eos_ids
    gen_path.write_text(json.dumps(gen, indent=2) + "\n")
    return model_dir


# --- control tokens: text from messages, observations and repositories is encoded as text ---------

@dataclass(frozen=True)
class _Encoding:
    """How one tokenizer encodes text as text: its special tokens, a pattern that finds their
    strings (longest first), and a function giving the ids of text with those strings split."""

    specials: Mapping[str, int]
    pattern: re.Pattern | None
    encode: Callable[[str], list[int]]


_ENCODINGS: "weakref.WeakKeyDictionary[Any, _Encoding]" = weakref.WeakKeyDictionary()
_ENCODINGS_LOCK = threading.Lock()


def _backend_encoding(backend: Any, where: str) -> _Encoding:
    # A copy of the tokenizer's own pipeline with special tokens split, set once and never toggled:
    # transformers' ``split_special_tokens=True`` flips a flag on the shared Rust tokenizer for the
    # call, and another thread's ordinary encode between the flip and the call would parse them again.
    from tokenizers import Tokenizer as RustTokenizer

    added = backend.get_added_tokens_decoder()
    specials = {token.content: int(i) for i, token in added.items() if token.special}
    stripping = sorted(t.content for t in added.values() if t.special and (t.lstrip or t.rstrip or t.single_word))
    if stripping:
        raise ValueError(f"{where}: special tokens {stripping} take whitespace around them (lstrip, rstrip or "
                         "single_word); their markers cannot be told from text by their strings alone")
    text_backend = RustTokenizer.from_str(backend.to_str())
    text_backend.encode_special_tokens = True
    return _Encoding(specials, _pattern(specials), lambda text: list(text_backend.encode(text, add_special_tokens=False).ids))


def _pattern(specials: Mapping[str, int]) -> re.Pattern | None:
    if not specials:
        return None
    return re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))


def _encoding(tokenizer: Any) -> _Encoding:
    try:
        with _ENCODINGS_LOCK:
            cached = _ENCODINGS.get(tokenizer)
    except TypeError:  # not weakly referable: computed each time
        cached = None
    if cached is not None:
        return cached
    where = f"tokenizer {type(tokenizer).__name__}"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "encode_special_tokens") and hasattr(tokenizer, "to_str"):
        backend = tokenizer  # a tokenizers.Tokenizer itself
    if backend is not None:
        encoding = _backend_encoding(backend, where)
    else:
        names = list(getattr(tokenizer, "all_special_tokens", None) or [])
        specials = {name: int(tokenizer.convert_tokens_to_ids(name)) for name in names}

        def encode(text: str) -> list[int]:
            if not specials:  # a tokenizer without special tokens cannot parse any out of text
                ids = tokenizer.encode(text, add_special_tokens=False)
                return list(getattr(ids, "ids", ids))
            try:
                ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
            except TypeError:
                raise TypeError(f"{where} has special tokens {sorted(specials)} but its encode() takes no "
                                "split_special_tokens: give a Hugging Face tokenizer") from None
            return list(getattr(ids, "ids", ids))

        encoding = _Encoding(specials, _pattern(specials), encode)
    try:
        with _ENCODINGS_LOCK:
            _ENCODINGS[tokenizer] = encoding
    except TypeError:
        pass
    return encoding


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of ``tokenizer``'s special tokens: the control tokens (turn markers, end of text) that
    only a template, or the model itself, may put into a context."""
    return frozenset(_encoding(tokenizer).specials.values())


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """The ids of ``text`` as text: a special token's string in it (``<|im_end|>``) becomes the
    ordinary tokens of its characters, never the special id. No template markers, no BOS."""
    return _encoding(tokenizer).encode(text)


class TemplateText:
    """Encodes what a template wrote around data so that only the template's own markers are
    special tokens.

    Hide every piece of data before the template sees it (:meth:`hide`: each special token's string
    in a string, however deeply nested in lists and dicts, becomes a placeholder of letters and
    digits that no JSON or Jinja filter changes, with a random part no data can spell), render, then
    :meth:`encode` the rendering: every special token's string in it is the template's, encoded as
    its id; the text between markers, placeholders turned back into the strings they hid, is encoded
    as text (:func:`encode_text`). :meth:`reveal` gives the rendering as the model reads it. Use one
    instance per rendering.

        text = TemplateText(tokenizer)
        ids = text.encode(render(text.hide(task)))
    """

    def __init__(self, tokenizer: Any):
        self._encoding = _encoding(tokenizer)
        nonce = secrets.token_hex(8)
        self._strings = sorted(self._encoding.specials)
        self._placeholder = {s: f"ctl{nonce}x{k}y" for k, s in enumerate(self._strings)}
        self._placeholders = re.compile(f"ctl{nonce}x([0-9]+)y")

    def hide(self, value: Any) -> Any:
        """``value`` with each special token's string in its strings (and in the strings of its lists,
        tuples and dict values) replaced by a placeholder; anything else as it is. Never changes
        ``value`` itself."""
        pattern = self._encoding.pattern
        if pattern is None:
            return value
        if isinstance(value, str):
            return pattern.sub(lambda m: self._placeholder[m.group()], value)
        if isinstance(value, Mapping):
            return {key: self.hide(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            hidden = [self.hide(item) for item in value]
            return hidden if isinstance(value, list) else tuple(hidden)
        return value

    def reveal(self, rendered: str) -> str:
        """``rendered`` with the placeholders turned back into the strings they hid."""
        return self._placeholders.sub(lambda m: self._strings[int(m.group(1))], rendered)

    def encode(self, rendered: str) -> list[int]:
        """The ids of a rendering of hidden data: the template's markers as their special ids, all
        else as text."""
        pattern = self._encoding.pattern
        if pattern is None:
            return self._encoding.encode(rendered)
        ids: list[int] = []
        start = 0
        for marker in pattern.finditer(rendered):
            if marker.start() > start:
                ids += self._encoding.encode(self.reveal(rendered[start:marker.start()]))
            ids.append(self._encoding.specials[marker.group()])
            start = marker.end()
        if start < len(rendered):
            ids += self._encoding.encode(self.reveal(rendered[start:]))
        return ids


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> tuple[list[int], str]:
    """``(prompt_ids, prompt_text)`` of a chat call: ``messages`` and ``tools`` rendered with the
    tokenizer's chat template and the generation prompt, the template's markers as their special ids
    and every string the messages and tools carry (contents, tool results, tool calls, declarations)
    encoded as text. For messages without special-token strings the ids are those of
    ``apply_chat_template(..., tokenize=True)``."""
    text = TemplateText(tokenizer)
    rendered = tokenizer.apply_chat_template(text.hide(messages), tools=text.hide(tools), add_generation_prompt=True,
                                             tokenize=False)
    return text.encode(rendered), text.reveal(rendered)


def fit_chat_turns(model_dir: str | Path, chats: list[dict], *, steps: int = 300, lr: float = 3e-3,
                   seed: int = 0) -> list[float]:
    """Teach the (tiny) model in ``model_dir`` to answer each chat's assistant turns, in place.

    ``chats`` are ``{"messages": [...], "tools": [...]}``; every assistant message in them is a turn
    the model learns to produce, exactly as the chat template renders it, up to and including its
    ``<|im_end|>``. Full-parameter training until greedy decoding reproduces the turns: a tiny random
    model that answers a scripted agent chat (tool calls included) gives tests and demos a real
    engine, template and tool-call parser to run through, with answers known in advance. Returns the
    loss per step.
    """
    # heavy: torch and transformers; only fitting chat turns needs them
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    turn_start = tokenizer.convert_tokens_to_ids(TURN_START)
    examples = []
    for chat in chats:
        messages, tools = chat["messages"], chat.get("tools")
        ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
        ids = list(getattr(ids, "input_ids", ids))
        mask = [0] * len(ids)
        # An assistant turn's tokens follow the prompt that ends with "<|im_start|>assistant\n".
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = tokenizer.apply_chat_template(messages[:i], tools=tools, add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
            through = tokenizer.apply_chat_template(messages[:i + 1], tools=tools, tokenize=True, return_dict=False)
            before, through = list(getattr(before, "input_ids", before)), list(getattr(through, "input_ids", through))
            if through[:len(before)] != before or ids[:len(through)] != through:
                raise ValueError(f"chat template: turn {i} does not extend the turns before it")
            end = len(through) - 1 if through[-1] != turn_start else len(through)
            while end > len(before) and tokenizer.convert_ids_to_tokens(through[end - 1]) != TURN_END:
                end -= 1  # up to and including <|im_end|>; the newline after it is the next prompt's
            for j in range(len(before), end):
                mask[j] = 1
        examples.append((ids, mask))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        total = 0.0
        optimizer.zero_grad()
        for ids, mask in examples:
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits[0, :-1]
            target = x[0, 1:]
            weights = torch.tensor(mask[1:], dtype=torch.float32)
            nll = torch.nn.functional.cross_entropy(logits, target, reduction="none")
            loss = (nll * weights).sum() / weights.sum()
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total / len(examples))
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    return losses
