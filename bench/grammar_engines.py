"""xgrammar against llguidance: the cost of one step's token bitmask for a whole batch.

    python -m bench.grammar_engines                     # batch 32, 1 thread, 3 grammars
    python -m bench.grammar_engines --batch 32 --threads 2 --steps 200

Both engines get the default model's tokenizer (SmolLM2-135M-Instruct, 49,152 ids, loaded from
the local model folder, nothing downloaded). For each grammar (a nested JSON schema, free JSON,
a regex) `--batch` matchers walk a valid token path, each starting at a different offset so the
batch holds matchers in many states; every step fills the bitmask of the whole batch with the
engine's batch call, then every matcher accepts its next token (a matcher that reaches the end of
the path starts over). Reported per grammar and engine: the cold compile time, the mean fill time
of one batch step and of the accepts. The two engines alternate (ABBA) in one process.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "active", "role", "tags", "address"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "active": True, "role": "admin", "tags": ["math", "poetry"],
            "address": {"city": "London", "zip": "W1"}}
REGEX = r"\d{3}-\d{3}-\d{4}( ext\. \d{1,5})?"
REGEX_TEXT = "555-867-5309 ext. 42"
# (name, kind, grammar, a valid text)
GRAMMARS = [
    ("json_schema", "schema", SCHEMA, json.dumps(INSTANCE, separators=(",", ":"))),
    ("json_object", "json", None, json.dumps({"id": 7, "items": [1, 2, {"k": "v"}], "ok": False, "note": "x y"},
                                             separators=(",", ":"))),
    ("regex", "regex", REGEX, REGEX_TEXT),
]


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos: list[int], threads: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
        self.threads = threads
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, kind: str, grammar):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "schema":
            return compiler.compile_json_schema(json.dumps(grammar), any_whitespace=False, separators=(",", ":"))
        if kind == "json":
            return compiler.compile_builtin_json_grammar()
        return compiler.compile_regex(grammar)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def reset(self, matcher) -> None:
        matcher.reset()


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos: list[int], threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.lg, self.lgt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos[0])
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, kind: str, grammar):
        M = self.lg.LLMatcher
        if kind == "schema":
            text = M.grammar_from_json_schema(json.dumps(grammar), defaults={"whitespace_flexible": False})
        elif kind == "json":
            text = M.grammar_from_json_schema('{"type": "object"}', defaults={"whitespace_flexible": False})
        else:
            text = M.grammar_from_regex(grammar)
        matcher = M(self.tokenizer, text)  # llguidance compiles lazily: the first matcher pays
        assert not matcher.is_error(), matcher.get_error()
        return text

    def matcher(self, compiled):
        return self.lg.LLMatcher(self.tokenizer, compiled)

    def fill(self, matchers, bitmask) -> None:
        self.lgt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)

    def reset(self, matcher) -> None:
        matcher.reset()


def walk(engine, compiled, path: list[int], batch: int, steps: int, vocab: int) -> dict:
    matchers = [engine.matcher(compiled) for _ in range(batch)]
    pos = [0] * batch
    for i, m in enumerate(matchers):  # spread the batch over the path
        for t in path[: i % len(path)]:
            assert engine.accept(m, t)
        pos[i] = i % len(path)
    bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
    fill_s = accept_s = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.fill(matchers, bitmask)
        t1 = time.perf_counter()
        for i, m in enumerate(matchers):
            token = path[pos[i]]
            assert (bitmask[i, token // 32] >> (token % 32)) & 1, f"{engine.name}: a valid token is masked"
            assert engine.accept(m, token)
            pos[i] += 1
            if pos[i] == len(path):
                engine.reset(m)
                pos[i] = 0
        accept_s += time.perf_counter() - t1
        fill_s += t1 - t0
    return {"fill_ms": 1e3 * fill_s / steps, "accept_ms": 1e3 * accept_s / steps}


def measure(args) -> list[dict]:
    from inferline.worker.engine.models.loader import load_config, load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(None)
    tokenizer, config = load_tokenizer(model_dir), load_config(model_dir)
    vocab, eos = config.vocab_size, [tokenizer.eos_token_id]
    t0 = time.perf_counter()
    xg = Xgrammar(tokenizer, vocab, eos, args.threads)
    t1 = time.perf_counter()
    lg = Llguidance(tokenizer, vocab, eos, args.threads)
    t2 = time.perf_counter()
    print(f"tokenizer setup: xgrammar {t1 - t0:.2f} s, llguidance {t2 - t1:.2f} s")
    rows = []
    for name, kind, grammar, text in GRAMMARS:
        path = tokenizer(text, add_special_tokens=False)["input_ids"] + eos
        for engine in (xg, lg, lg, xg):
            c0 = time.perf_counter()
            compiled = engine.compile(kind, grammar)
            compile_ms = 1e3 * (time.perf_counter() - c0)
            res = walk(engine, compiled, path, args.batch, args.steps, vocab)
            rows.append({"grammar": name, "engine": engine.name, "compile_ms": compile_ms, **res})
    return rows


def report(rows: list[dict]) -> None:
    print(f"{'grammar':12} {'engine':10} {'compile ms':>10} {'fill ms/step':>12} {'accept ms/step':>14}")
    for name, *_ in GRAMMARS:
        for engine in ("xgrammar", "llguidance"):
            mine = [r for r in rows if r["grammar"] == name and r["engine"] == engine]
            mean = lambda k: sum(r[k] for r in mine) / len(mine)  # noqa: E731
            print(f"{name:12} {engine:10} {mean('compile_ms'):10.1f} {mean('fill_ms'):12.3f} "
                  f"{mean('accept_ms'):14.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report(measure(args))


if __name__ == "__main__":
    main()
