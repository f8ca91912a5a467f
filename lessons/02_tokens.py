"""Lesson 2: text -> token ids -> text, and why detokenisation is incremental."""
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python lessons/NN_x.py` from a checkout

from engine import SamplingParams  # noqa: E402
from lessons.cli import main  # noqa: E402
from lessons.framework import events_of, queue_request, table  #noqa:E402

TITLE = "Tokens: text → ids → text"
SUMMARY = "BPE subword tokens (merges, Ġ spaces, bytes for emoji), round trips, and why a streamed character waits."
PROMPT = "Return the tokenizer's vocabulary 👋"
WORD = " function"  # a word whose BPE merges the lesson replays
STEER = " café 👋"  # what we make the engine "generate", one token at a time
BAD = "\ufffd"  # U+FFFD, what a decoder prints for bytes that are not (yet) a whole character


def bpe_steps(word_bytes: str, ranks: dict[tuple[str, str], int]) -> list[list[str]]:
    """Byte-level BPE on one pre-token, as GPT-2 defines it: start from its bytes (as vocabulary
    characters) and keep merging the adjacent pair that was learned earliest. Every state, in order."""
    parts, steps = list(word_bytes), []
    steps.append(list(parts))
    while len(parts) > 1:
        pairs = [(ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank == 1 << 30:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
        steps.append(list(parts))
    return steps


def _merged(before: list[str], after: list[str], ranks: dict[tuple[str, str], int]) -> str:
    i = next(i for i, (x, y) in enumerate(zip(before, after)) if x != y)
    return f"{before[i]} + {before[i + 1]} ({ranks[(before[i], before[i + 1])]})"


class Steered:
    """The model runner's sampler with one request's tokens replaced by `tokens`, in order (the
    sampler's other methods, which keep each request's settings by slot, are the real sampler's)."""

    def __init__(self, sampler, request_id: str, tokens: list[int]):
        self.sampler, self.request_id, self.tokens = sampler, request_id, tokens

    def __getattr__(self, name):
        return getattr(self.sampler, name)

    def __call__(self, logits, requests):
        out = self.sampler(logits, requests)
        out.token_ids = [self.tokens[len(r.output_token_ids)] if r.request_id == self.request_id else t
                         for r, t in zip(requests, out.token_ids)]
        return out


def run(lesson) -> None:
    lesson.intro(
        "A model reads and writes **token ids**, not text. You will see a prompt become ids, replay the "
        "**BPE merges** that turn a word into one token, see an emoji fall back to its bytes, and then "
        "watch the real engine stream a reply token by token: a step whose token ends in the middle of a "
        "character streams **nothing**, and the character appears whole once its last byte arrives.")
    llm, session = lesson.engine(num_kv_blocks=16)
    engine = llm.llm_engine
    tok = engine.tokenizer
    spec = json.loads(tok.backend_tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec.get("merges") or []]
    ranks = {m: i for i, m in enumerate(merges)}

    steer = tok.encode(STEER)
    req = queue_request(engine, "A", PROMPT, SamplingParams(temperature=0, max_tokens=len(steer), ignore_eos=True))
    enc, vocab = _the_prompt_becomes_ids(lesson, session, tok, req)
    if not merges:
        _without_merges_one_token_per_byte(lesson, req)
        return
    e_ids = _bpe_words_spaces_and_emoji_bytes(lesson, tok, req, enc, vocab, merges)
    _the_merges_replayed(lesson, tok, merges, ranks)
    _round_trips_on_real_text(lesson, tok)
    _streaming_waits_for_whole_characters(lesson, engine, session, req, steer, e_ids)


def _the_prompt_becomes_ids(lesson, session, tok, req):
    """The tokenizer's encode event, id by id. Returns (the event, each id's vocabulary entry)."""
    ids = req.prompt_token_ids
    enc = next(e for e in events_of(session) if e.layer == "tokenizer" and e.name == "encode")
    lesson.say(f"`add_request` tokenized the prompt `{PROMPT}` into {len(ids)} ids. Each id, alone:")
    vocab = tok.convert_ids_to_tokens(ids)
    lesson.show(table(["id", "vocabulary entry", "decoded alone"],
                      [[i, v, repr(p)] for i, v, p in zip(ids, vocab, enc.get("pieces"))],
                      title="the tokenizer's encode event"))
    lesson.check(enc.get("token_ids") == ids, "the tracer's encode event carries the same ids the request holds")
    return enc, vocab


def _without_merges_one_token_per_byte(lesson, req) -> None:
    ids = req.prompt_token_ids
    n_bytes = len(PROMPT.encode("utf-8"))
    lesson.say(f"This model's tokenizer ({lesson.model}) has **no merges**: every id is one UTF-8 byte, "
               f"so the prompt's {n_bytes} bytes are {len(ids)} tokens. The rest of the lesson needs BPE; "
               "run it on tiny-gpt2.")
    lesson.check(len(ids) == n_bytes, "without merges, one token per UTF-8 byte")


def _bpe_words_spaces_and_emoji_bytes(lesson, tok, req, enc, vocab, merges) -> list[int]:
    """Byte-level BPE: whole words, `Ġ` for a leading space, an emoji as bytes. Returns the emoji's ids."""
    ids = req.prompt_token_ids
    n_bytes = len(PROMPT.encode("utf-8"))
    lesson.say(
        f"This is a **byte-level BPE** tokenizer, as GPT-2 uses, with {len(tok)} entries: the 256 bytes, "
        f"{len(merges)} learned merges and `<|endoftext|>`. The vocabulary stores each byte as a printable "
        "stand-in, so a leading space shows as **`Ġ`**: words carry the space before them, so *the* after a "
        "space is the one token `Ġthe`, different from `the` at the start of a line. Rarer words are split "
        "into subwords.")
    spaced = [v for v in vocab if v.startswith("Ġ") and len(v) > 2]
    lesson.check(len(ids) < n_bytes, f"{n_bytes} UTF-8 bytes became {len(ids)} tokens: common words are one token")
    lesson.check(len(spaced) >= 2 and all(tok.decode([tok.convert_tokens_to_ids(v)]) == " " + v[1:] for v in spaced),
                 f"{', '.join(map(repr, spaced))} start with Ġ and decode to a space followed by the word")
    emoji = "👋"
    e_ids = tok.encode(emoji)
    lesson.check(len(e_ids) == len(emoji.encode("utf-8")) and set(e_ids) <= set(ids),
                 f"the emoji {emoji} is in no merge: it falls back to its {len(e_ids)} UTF-8 bytes, one token each")
    lesson.check(any(BAD in p for p in enc.get("pieces")),
                 "decoded one at a time, those byte tokens are not text at all (U+FFFD, the replacement character)")
    lesson.pause()
    return e_ids


def _the_merges_replayed(lesson, tok, merges, ranks) -> None:
    """Replay the merge list on WORD and get the tokenizer's own ids."""
    word = "".join(tok.convert_ids_to_tokens(tok.encode(WORD)))  # the word as vocabulary characters (Ġ...)
    steps = bpe_steps(word, ranks)
    n_word = len(tok.encode(WORD))
    plural = "s" if n_word > 1 else ""
    lesson.say(
        f"**How `{WORD.strip()}` (with its space) became {n_word} token{plural}.** "
        "BPE training counted adjacent pairs in the corpus and "
        f"merged the most frequent one, {len(merges)} times; the order is the merge list. Encoding a "
        "word replays it: start from the bytes, and merge the pair that was learned earliest, until no "
        "learned pair is left."
    )
    lesson.show(table(["step", "pieces", "merged pair (rank)"],
                      [[i, " · ".join(st), "" if i == 0 else _merged(steps[i - 1], st, ranks)]
                       for i, st in enumerate(steps)], title=f"BPE on {WORD!r}"))
    lesson.check(tok.convert_tokens_to_ids(steps[-1]) == tok.encode(WORD),
                 f"replaying the merge list gives exactly the tokenizer's ids for {WORD!r}: {tok.encode(WORD)}")
    lesson.pause()


def _round_trips_on_real_text(lesson, tok) -> None:
    """decode(encode(text)) == text, and how many bytes each token carries."""
    samples = {"this lesson's source": pathlib.Path(__file__).read_text(encoding="utf-8"),
               "the README": (ROOT / "README.md").read_text(encoding="utf-8"),
               "combining accent, ZWJ emoji, CJK": "e\u0301 👨‍👩‍👧 漢字\ttab\nnewline"}
    rows, all_ok = [], True
    for name, text in samples.items():
        t_ids = tok.encode(text)
        back = tok.decode(t_ids)
        all_ok &= back == text
        n_b = len(text.encode("utf-8"))
        rows.append([name, len(text), n_b, len(t_ids), f"{n_b / len(t_ids):.2f}", back == text])
    lesson.show(table(["text", "characters", "UTF-8 bytes", "tokens", "bytes per token", "decode(encode(t)) == t"],
                      rows, title="round trips"))
    lesson.check(all_ok, "decode(encode(text)) gives back every text exactly, emoji and CJK included")
    lesson.say("English prose like the README packs several bytes into each token; text the tokenizer never "
               "saw while training (CJK, emoji) falls back towards one token per byte. The model's context "
               "window and the KV cache are counted in tokens, so this ratio is what a prompt costs.")
    lesson.pause()


def _streaming_waits_for_whole_characters(lesson, engine, session, req, steer, e_ids) -> None:
    """The engine's real detokenizer: a step that ends mid-character streams nothing."""
    tok = engine.tokenizer
    emoji_at = len(steer) - len(e_ids)
    lesson.check(steer[emoji_at:] == e_ids,
                 f"{STEER!r} is {len(steer)} tokens and ends in the emoji's {len(e_ids)} byte tokens")
    lesson.say(
        "Now the engine generates. To make it write a character that spans several tokens (the model learned "
        "from documentation and writes emoji as rarely as its text did), we **steer its sampler**: each step, "
        "after the model and sampler run, the chosen token is replaced by the next token of "
        f"`{STEER}` ({', '.join(map(repr, tok.convert_ids_to_tokens(steer)))}). Everything after that — "
        "appending the token, detokenizing, streaming — is the engine's own code.")
    runner = engine.engine_core.engine_core.model_runner
    runner.sampler = Steered(runner.sampler, "A", steer)
    lesson.predict(
        "After the steps that sample the byte tokens 0xF0 0x9F 0x91 — three of the four bytes of '👋' — what "
        "has the engine streamed to the client for those steps?",
        "Nothing: each of those steps streams the empty string. The step that samples the 4th byte, "
        "0x8B, streams '👋' whole.")
    rows, pieces, naive, text = _stream_the_steered_reply(engine, session)
    lesson.show(table(["step", "sampled token", "streamed this step", "output text", "decoding each token alone"],
                      rows, title="the detokenizer's NEW_TOKENS events, step by step"))
    # Steps whose token leaves the text ending mid-character (decoding the prefix ends in U+FFFD).
    waiting = sum(tok.decode(steer[:i + 1]).endswith(BAD) for i in range(len(steer)))
    lesson.check(req.output_token_ids == steer, f"the engine appended the {len(steer)} steered tokens")
    lesson.check(waiting > 0 and [p == "" for p in pieces] == [tok.decode(steer[:i + 1]).endswith(BAD)
                                                              for i in range(len(steer))],
                 f"exactly the {waiting} steps whose token ended mid-character streamed nothing")
    lesson.check(all(BAD not in p for p in pieces), "no streamed piece ever holds a broken character")
    lesson.check("".join(pieces) == text == STEER == tok.decode(req.output_token_ids),
                 "the streamed pieces add up to exactly decode(all output ids)")
    lesson.check(BAD in naive, "decoding each token alone would have streamed U+FFFD garbage instead")
    lesson.say(
        "The engine's `IncrementalDetokenizer` wraps the `tokenizers` library's `DecodeStream`: it keeps "
        "the tokens it cannot yet turn into whole text and returns new text only when it is complete. "
        "vLLM V1 does the same in its front-end process (its fast incremental detokenizer is built on "
        "`DecodeStream`), and checks stop strings on that text.")
    lesson.done(
        "Text becomes ids on the way in: byte-level BPE merges common byte sequences (words, with their "
        "leading space as `Ġ`) into single tokens and leaves anything else as bytes, so every text has ids. "
        "Ids become text on the way out. Decoding cannot be done one token at a time: a character may span "
        "several tokens, so the detokenizer holds back incomplete bytes and streams each character once it is "
        "whole. Decoding "
        "everything at the end gives the same text."
    )


def _stream_the_steered_reply(engine, session):
    """Step the engine to the end. Returns (table rows, the piece streamed each step, the text of each
    token decoded alone, the output text)."""
    tok = engine.tokenizer
    rows, pieces, naive, text = [], [], "", ""
    while engine.has_unfinished_requests():
        for out in engine.step():  # the front end's RequestOutput: its text so far
            text = out.outputs[0].text
        new = [e for e in events_of(session) if e.layer == "detokenizer" and e.name == "NEW_TOKENS"][-1]
        t = new.get("token_ids")[0]
        pieces.append(new.get("text"))
        naive += tok.decode([t])
        rows.append([new.step, f"{t} {tok.convert_ids_to_tokens(t)!r}", repr(new.get("text")), repr(text),
                     repr(naive)])
    return rows, pieces, naive, text


if __name__ == "__main__":
    sys.exit(main(globals()))
