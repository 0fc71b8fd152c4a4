"""The local engine: a transformers + peft causal LM that answers SGLang's native API on CPU.

What it does, like an SGLang replica: one scheduler thread batches every running request into one
forward pass per decode step (continuous batching: requests join and leave between steps); prompts
are prefilled one by one, reusing the longest cached prefix; a block prefix cache keeps the KV of
finished and running sequences within a token budget (``max_total_tokens``), evicting least
recently used blocks, and when the running requests themselves outgrow the budget the newest one is
retracted (its KV freed, requeued, and recomputed from its prefix later). Several LoRA adapters
are loaded at once; each request names one with ``lora_path`` and a batch mixes them.

Logprobs are those of the distribution sampled from (logits divided by the temperature, before
top-k/top-p), which is SGLang's default; at temperature 1 they are the model's own.

torch, transformers, peft and safetensors are imported where they are first used, so that the
command line, the fleet and the tests import this module without loading them.
"""

from __future__ import annotations

import inspect
import itertools
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.prefix_cache import Block, PrefixCache
from serving.protocol import BASE_WEIGHT_VERSION, BadRequest, Completion, GenerateRequest, finish_reason
from serving.scheduler import KvScheduler


@dataclass(eq=False)
class _Req:
    request: GenerateRequest
    seq: list[int]  # prompt + output so far
    prompt_len: int
    order: int
    output_logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    locked: list[Block] = field(default_factory=list)
    kv_len: int = 0  # tokens whose KV is computed (seq[:kv_len])
    generator: Any = None
    finish: dict[str, Any] | None = None
    error: str | None = None
    done: Completion = field(default_factory=Completion)
    arrived_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    admitted_before: bool = False

    @property
    def adapter(self) -> str | None:
        return self.request.lora_path

    @property
    def output_len(self) -> int:
        return len(self.seq) - self.prompt_len

    # What the scheduler reads (serving.scheduler.Scheduled): the output so far is in the sequence.
    def prefix_tokens(self) -> list[int]:
        return self.seq

    def length(self) -> int:
        return len(self.seq)

    def kv_tokens(self) -> int:
        return self.kv_len


class LocalEngine:
    """A CPU engine over a transformers causal LM (see the module docstring)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        max_total_tokens: int = 65536,
        max_running_requests: int = 64,
        block_size: int = 16,
        admission_reserve_tokens: int = 32,
        max_prefill_batch: int = 16,
        torch_threads: int | None = None,
        weight_version: str = BASE_WEIGHT_VERSION,
    ):
        # heavy: torch and transformers; only an engine that loads a model needs them
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self._torch = torch
        self.model_path = str(model_path)
        self.config = AutoConfig.from_pretrained(model_path)
        self.base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.base.eval()
        self._cache_arg = "past_key_values" if "past_key_values" in inspect.signature(self.base.forward).parameters else "cache"
        self.model = self.base  # becomes a PeftModel once an adapter is loaded
        self.tokenizer = None
        try:
            # heavy: transformers (and torch through it)
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        except Exception:  # a model without a tokenizer still serves token ids
            self.tokenizer = None
        self.vocab_size = int(self.config.vocab_size)
        eos = self.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        self.max_context = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self.max_total_tokens = max_total_tokens
        self.max_running_requests = max_running_requests
        self.max_prefill_batch = max_prefill_batch  # prompts of equal shape prefilled in one forward
        self.weight_version = weight_version
        self.cache = PrefixCache(block_size)
        self.scheduler: KvScheduler[_Req] = KvScheduler(
            self.cache, max_total_tokens=max_total_tokens, max_running_requests=max_running_requests,
            admission_reserve_tokens=admission_reserve_tokens)
        self._adapters: dict[str, str] = {}
        self._lock = threading.Lock()  # guards the scheduler's queues, the cache and the adapters
        self._model_lock = threading.Lock()  # held by the scheduler thread while it runs the model
        self._wake = threading.Condition(self._lock)
        # The batched KV of the running requests: per layer (K, V) of [B, kv_heads, L, head_dim],
        # left padded; row i holds its tokens in columns pad[i]:L.
        self._kv: list[tuple[Any, Any]] | None = None
        self._pad: list[int] = []
        self._mask = None
        self._batch: list[_Req] = []
        self._gen_window: deque[tuple[float, int]] = deque(maxlen=64)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()

    # --- the InProcessEngine protocol -------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> dict[str, Any]:
        req = self._submit(request)
        req.done.wait()
        return self._answer(req)

    async def agenerate(self, request: GenerateRequest) -> dict[str, Any]:
        """:meth:`generate` awaited on the caller's event loop: the model runs on the scheduler
        thread, which wakes the loop when the call ends (:class:`serving.protocol.Completion`)."""
        req = self._submit(request)
        await req.done
        return self._answer(req)

    def _submit(self, request: GenerateRequest) -> _Req:
        """Check ``request`` and queue it for the scheduler thread."""
        for tok in request.input_ids:
            if tok >= self.vocab_size:
                raise BadRequest(f"input_ids holds token id {tok}, outside the vocabulary (size {self.vocab_size})")
        if len(request.input_ids) + 1 > self.max_total_tokens:
            raise BadRequest(f"input_ids has {len(request.input_ids)} tokens; the KV budget is {self.max_total_tokens}")
        if len(request.input_ids) >= self.max_context:
            raise BadRequest(f"input_ids has {len(request.input_ids)} tokens; the model's context is {self.max_context}")
        with self._lock:
            if request.lora_path is not None and request.lora_path not in self._adapters:
                raise BadRequest(f"lora_path {request.lora_path!r} is not loaded (loaded: {sorted(self._adapters)})")
            if self._closed:
                raise RuntimeError("engine is shut down")
            req = _Req(request, list(request.input_ids), len(request.input_ids), self.scheduler.next_order())
            if request.sampling_params.seed is not None:
                req.generator = self._torch.Generator().manual_seed(request.sampling_params.seed)
            self.scheduler.submit(req)
            self._wake.notify()
        return req

    def _answer(self, req: _Req) -> dict[str, Any]:
        """The finished call's answer in SGLang's ``/generate`` shape."""
        if req.error is not None:
            raise RuntimeError(req.error)
        request = req.request
        now = time.perf_counter()
        output_ids = req.seq[req.prompt_len:]
        meta: dict[str, Any] = {
            "id": request.rid,
            "prompt_tokens": req.prompt_len,
            "completion_tokens": len(output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finish,
            "weight_version": request.lora_path or self.weight_version,
            "lora_path": request.lora_path,
            "e2e_latency": now - req.arrived_s,
        }
        if request.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(req.output_logprobs, output_ids)]
        text = self.tokenizer.decode(output_ids) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": output_ids, "meta_info": meta}

    def load_lora_adapter(self, name: str, path: str) -> None:
        # heavy: peft; only loading an adapter needs it
        from peft import PeftModel

        adapter_dir = Path(path)
        if not (adapter_dir / "adapter_config.json").is_file():
            raise BadRequest(f"lora_path {path!r} is not a peft adapter directory (no adapter_config.json)")
        _check_adapter_files(adapter_dir)  # before peft touches the model: a bad file must not half-load
        with self._model_lock, self._lock:
            if name in self._adapters:
                raise BadRequest(f"lora_name {name!r} is already loaded; unload it first or pick a new name")
            if self.model is self.base:
                self.model = PeftModel.from_pretrained(self.base, str(adapter_dir), adapter_name=name)
                self.model.eval()
            else:
                self.model.load_adapter(str(adapter_dir), adapter_name=name)
            self._adapters[name] = str(adapter_dir)

    def unload_lora_adapter(self, name: str) -> None:
        with self._model_lock, self._lock:
            if name not in self._adapters:
                raise BadRequest(f"lora_name {name!r} is not loaded (loaded: {sorted(self._adapters)})")
            busy = sum(1 for r in itertools.chain(self.scheduler.running, self.scheduler.waiting) if r.adapter == name)
            if busy:
                raise BadRequest(f"lora_name {name!r} is in use by {busy} requests; retry when they finish")
            self.cache.drop_adapter(name)
            if len(self._adapters) == 1:
                self.base = self.model.unload()  # the base model with the LoRA layers taken out
                self.base.eval()
                self.model = self.base
            else:
                self.model.delete_adapter(name)
            del self._adapters[name]

    def adapters(self) -> list[str]:
        with self._lock:
            return sorted(self._adapters)

    def server_info(self) -> dict[str, Any]:
        return {
            "engine": "posttrain-local",
            "model_path": self.model_path,
            "max_total_num_tokens": self.max_total_tokens,
            "max_running_requests": self.max_running_requests,
            "page_size": self.cache.block_size,
            "enable_lora": True,
            "loaded_adapters": self.adapters(),
            "weight_version": self.weight_version,
            "vocab_size": self.vocab_size,
        }

    def metrics(self) -> dict[str, float]:
        with self._lock:
            now = time.perf_counter()
            window = [n for t, n in self._gen_window if now - t < 5.0]
            return {**self.scheduler.metrics(), "gen_throughput": sum(window) / 5.0}

    @property
    def num_retracted_reqs(self) -> int:
        return self.scheduler.num_retracted_reqs

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for req in list(self.scheduler.waiting) + self.scheduler.running:
                req.error = "engine shut down"
                req.done.set()
            self.scheduler.waiting.clear()
            self._wake.notify_all()
        self._thread.join(timeout=5)

    # --- the scheduler thread (admission, retraction and KV accounting: serving.scheduler) -----

    def _loop(self) -> None:
        torch = self._torch
        with torch.inference_mode():
            while True:
                with self._lock:
                    while not self.scheduler.waiting and not self.scheduler.running and not self._closed:
                        self._wake.wait()
                    if self._closed:
                        return
                    admitted = self.scheduler.admit(self._on_admit, self._on_unfit)
                try:
                    with self._model_lock:
                        if admitted:
                            self._prefill(admitted)
                        if self._batch:
                            self._decode_step()
                except Exception as exc:  # a bug must fail the requests, not hang them
                    with self._lock:
                        for req in admitted + self.scheduler.running:
                            if not req.done.is_set():
                                req.error = f"engine error: {exc!r}"
                                req.done.set()
                        for req in self.scheduler.running:
                            self.cache.unlock(req.locked)
                        self.scheduler.running.clear()
                        self._kv, self._pad, self._mask, self._batch = None, [], None, []

    @staticmethod
    def _on_admit(req: _Req, chain: list[Block], hit: int) -> None:
        req.locked = chain
        req.kv_len = len(req.seq)  # reserved now; the prefill computes seq[hit:]

    def _on_unfit(self, req: _Req, need: int) -> None:
        req.finish = finish_reason("abort", f"request needs {need} tokens; the budget is {self.max_total_tokens}")
        req.error = f"prompt of {len(req.seq)} tokens does not fit the KV budget of {self.max_total_tokens} tokens"
        req.done.set()

    def _forward(self, input_ids, positions, mask, kv, adapters: list[str | None]):
        # heavy: transformers (and torch through it)
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=kv) if kv else DynamicCache()
        kwargs: dict[str, Any] = {}
        if self.model is not self.base:
            kwargs["adapter_names"] = [a if a is not None else "__base__" for a in adapters]
        # transformers names the cache argument ``past_key_values`` (4.x, 5.19) or ``cache`` (5.17).
        kwargs[self._cache_arg] = cache
        out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True, **kwargs)
        returned = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
        new_kv = [(layer.keys, layer.values) for layer in returned.layers]
        return out.logits[:, -1, :], new_kv

    def _prefill(self, admitted: list[_Req]) -> None:
        """Prefill the admitted requests, one forward pass per group of equal shape (same cached
        prefix length, same length): the members of a GRPO group arrive together and share one."""
        with self._lock:
            bs = self.cache.block_size
            groups: dict[tuple[int, int], list[_Req]] = {}
            for req in admitted:
                groups.setdefault((len(req.locked) * bs, len(req.seq)), []).append(req)
        for (hit, n), reqs in groups.items():
            for start in range(0, len(reqs), self.max_prefill_batch):
                self._prefill_group(reqs[start:start + self.max_prefill_batch], hit, n)

    def _prefill_group(self, reqs: list[_Req], hit: int, n: int) -> None:
        torch = self._torch
        with self._lock:
            prefixes = [[b.payload for b in req.locked] for req in reqs]
        if hit:
            layers = len(prefixes[0][0])
            kv = [
                (torch.cat([torch.cat([p[layer][0] for p in prefix], dim=2) for prefix in prefixes]),
                 torch.cat([torch.cat([p[layer][1] for p in prefix], dim=2) for prefix in prefixes]))
                for layer in range(layers)
            ]
        else:
            kv = None
        input_ids = torch.tensor([req.seq[hit:] for req in reqs])
        positions = torch.arange(hit, n).unsqueeze(0).expand(len(reqs), -1)
        mask = torch.ones(len(reqs), n, dtype=torch.long)
        logits, kv = self._forward(input_ids, positions, mask, kv, [req.adapter for req in reqs])
        bs = self.cache.block_size
        full = n // bs
        with self._lock:
            # Cache the prompts' full blocks now so that later requests sharing them hit.
            for row, req in enumerate(reqs):
                req.kv_len = n
                if full > len(req.locked):
                    # The request's private tokens become locked blocks: usage does not change.
                    payloads: list[Any] = [None] * full
                    for i in range(len(req.locked), full):
                        lo, hi = i * bs, (i + 1) * bs
                        payloads[i] = [(k[row:row + 1, :, lo:hi].clone(), v[row:row + 1, :, lo:hi].clone()) for k, v in kv]
                    chain = self.cache.insert(req.adapter, req.seq[:full * bs], payloads, have=req.locked)
                    self.cache.lock(chain[len(req.locked):])
                    req.locked = chain
        tokens = self._sample(logits, reqs)
        now = time.perf_counter()
        for row, (req, token) in enumerate(zip(reqs, tokens)):
            req.first_token_s = now
            self._append(req, token)
            if req.finish is not None:
                self._finish_rows([req], in_batch=False)
            else:
                self._merge_into_batch(req, [(k[row:row + 1], v[row:row + 1]) for k, v in kv])

    def _merge_into_batch(self, req: _Req, kv) -> None:
        torch = self._torch
        F = torch.nn.functional
        n = kv[0][0].shape[2]
        if self._kv is None:
            self._kv, self._pad = kv, [0]
            self._mask = torch.ones(1, n, dtype=torch.long)
            self._batch = [req]
            return
        length = self._kv[0][0].shape[2]
        if n > length:
            grow = n - length
            self._kv = [(F.pad(k, (0, 0, grow, 0)), F.pad(v, (0, 0, grow, 0))) for k, v in self._kv]
            self._mask = F.pad(self._mask, (grow, 0))
            self._pad = [p + grow for p in self._pad]
            length = n
        lead = length - n
        kv = [(F.pad(k, (0, 0, lead, 0)), F.pad(v, (0, 0, lead, 0))) for k, v in kv]
        self._kv = [(torch.cat([bk, k]), torch.cat([bv, v])) for (bk, bv), (k, v) in zip(self._kv, kv)]
        row_mask = torch.zeros(1, length, dtype=torch.long)
        row_mask[0, lead:] = 1
        self._mask = torch.cat([self._mask, row_mask])
        self._pad.append(lead)
        self._batch.append(req)

    def _decode_step(self) -> None:
        torch = self._torch
        batch = self._batch
        with self._lock:
            # Every row grows by one token this step; retract the newest rows if that overflows.
            retract = self.scheduler.retract_newest(1)
            for victim in retract:
                victim.kv_len = 0
        if retract:
            self._remove_rows(retract)
            batch = self._batch
            if not batch:
                return
        length = self._kv[0][0].shape[2]
        input_ids = torch.tensor([[r.seq[-1]] for r in batch])
        positions = torch.tensor([[length - p] for p in self._pad])
        self._mask = torch.cat([self._mask, torch.ones(len(batch), 1, dtype=torch.long)], dim=1)
        logits, self._kv = self._forward(input_ids, positions, self._mask, self._kv, [r.adapter for r in batch])
        tokens = self._sample(logits, batch)
        finished = []
        for req, token in zip(batch, tokens):
            req.kv_len += 1
            self._append(req, token)
            if req.finish is not None:
                finished.append(req)
        with self._lock:
            self._gen_window.append((time.perf_counter(), len(batch)))
        if finished:
            self._finish_rows(finished, in_batch=True)

    def _append(self, req: _Req, token: int) -> None:
        req.seq.append(token)
        self.scheduler.generation_tokens_total += 1
        sp = req.request.sampling_params
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_ids):
            req.finish = finish_reason("stop", token)
        elif req.output_len >= sp.max_new_tokens or len(req.seq) >= self.max_context:
            req.finish = finish_reason("length", req.output_len)

    def _sample(self, logits, reqs: list[_Req]) -> list[int]:
        torch = self._torch
        temps = torch.tensor([r.request.sampling_params.temperature or 1.0 for r in reqs]).unsqueeze(1)
        logprobs = torch.log_softmax(logits.float() / temps, dim=-1)
        tokens = [0] * len(reqs)
        plain = [i for i, r in enumerate(reqs) if r.request.sampling_params.temperature > 0 and r.request.sampling_params.is_plain]
        if plain:
            drawn = torch.multinomial(logprobs[plain].exp(), 1).squeeze(1).tolist()
            for i, t in zip(plain, drawn):
                tokens[i] = t
        for i, r in enumerate(reqs):
            sp = r.request.sampling_params
            if sp.temperature == 0:
                tokens[i] = int(torch.argmax(logprobs[i]))
            elif not sp.is_plain:
                row = logprobs[i].clone()
                if sp.top_k > 0:
                    kth = torch.topk(row, min(sp.top_k, row.numel())).values[-1]
                    row[row < kth] = float("-inf")
                if sp.top_p < 1.0:
                    sorted_lp, order = torch.sort(row, descending=True)
                    cum = torch.cumsum(sorted_lp.exp(), dim=0)
                    drop = cum - sorted_lp.exp() > sp.top_p
                    row[order[drop]] = float("-inf")
                tokens[i] = int(torch.multinomial(torch.softmax(row, dim=-1), 1, generator=r.generator))
        chosen = logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
        for r, lp in zip(reqs, chosen):
            r.output_logprobs.append(lp)
        return tokens

    def _remove_rows(self, rows: list[_Req]) -> None:
        torch = self._torch
        keep = [i for i, r in enumerate(self._batch) if r not in rows]
        if not keep:
            self._kv, self._pad, self._mask, self._batch = None, [], None, []
            return
        index = torch.tensor(keep)
        pads = [self._pad[i] for i in keep]
        trim = min(pads)
        self._kv = [(k.index_select(0, index)[:, :, trim:], v.index_select(0, index)[:, :, trim:]) for k, v in self._kv]
        self._mask = self._mask.index_select(0, index)[:, trim:]
        self._pad = [p - trim for p in pads]
        self._batch = [self._batch[i] for i in keep]

    def _finish_rows(self, rows: list[_Req], *, in_batch: bool) -> None:
        bs = self.cache.block_size
        kv_rows = {}
        if in_batch:
            for i, r in enumerate(self._batch):
                if r in rows:
                    kv_rows[id(r)] = (i, self._pad[i])
        with self._lock:
            for req in rows:
                full = req.kv_len // bs
                if in_batch and full > len(req.locked):
                    row, pad = kv_rows[id(req)]
                    payloads: list[Any] = [None] * full
                    for b in range(len(req.locked), full):
                        lo, hi = pad + b * bs, pad + (b + 1) * bs
                        payloads[b] = [(k[row:row + 1, :, lo:hi].clone(), v[row:row + 1, :, lo:hi].clone()) for k, v in self._kv]
                    # The row's private tokens become cached blocks: usage does not grow.
                    self.cache.insert(req.adapter, req.seq[:full * bs], payloads, have=req.locked)
                self.cache.unlock(req.locked)
                req.locked = []
                self.scheduler.running.remove(req)
                req.done.set()
        if in_batch:
            self._remove_rows(rows)


def _check_adapter_files(adapter_dir: Path) -> None:
    """Refuse an adapter folder whose files are not whole (truncated, garbage) with a clear error."""
    # heavy: safetensors; only checking an adapter's files needs it
    from safetensors import safe_open

    config_path = adapter_dir / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or "peft_type" not in config:
        raise BadRequest(f"{config_path} must be a peft adapter config (an object with peft_type)")
    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        if (adapter_dir / "adapter_model.bin").is_file():
            return
        raise BadRequest(f"lora_path {str(adapter_dir)!r} has no adapter_model.safetensors")
    try:
        with safe_open(str(weights), framework="pt") as f:
            for key in f.keys():
                f.get_slice(key)
    except Exception as exc:  # safetensors raises its own error types for a bad header or size
        raise BadRequest(f"{weights} is not a whole safetensors file: {exc}") from None
