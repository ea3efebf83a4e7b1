#!/usr/bin/env python3
"""Convert HotpotQA / 2WikiMultihopQA (distractor format) and MuSiQue to the LongBench JSONL
that `specrag-eval` reads, with a seeded sample of the questions.

Input: a JSON-lines file (or a JSON list) of records in the HotpotQA shape shared by the first
two datasets: `_id`, `question`, `answer`, `context` ([[title, [sentence, ...]], ...]) and
`supporting_facts` ([[title, sentence index], ...]); in MuSiQue's: `id`, `question`,
`answer`, `answer_aliases`, `answerable` and `paragraphs` ([{title, paragraph_text,
is_supporting}, ...]); or in CacheBlend's evaluation files' (`inputs/*_s.json`): `question`,
`answers` ([[answer, alias, ...]]) and `ctxs` ([{title, text}, ...], retrieved passages of about
400 words, often untitled), numbered by their place in the file as they carry no id and
without supporting passages (the file names none). Records without a context, with fewer
than --min-passages passages, without an answer or marked unanswerable are left out before
sampling. Or SAMSum's dialogues (`split`, `question`: the dialogue, `answer`: its summary),
made into CacheBlend's `inputs/samsum.json` setting, summaries with few-shot examples: each
`test` dialogue is a question whose passages are --examples dialogues of the `train` and
`validation` splits with their summaries ("Dialogue: ...\nSummary: ..."), drawn per question
with the seed; its id is its place among the `test` records.

Output, one line per question, LongBench's fields (`input`, `context`, `answers`, `length`,
`dataset`, `language`, `all_classes`, `_id`) plus `supporting` (the titles of the passages the
answer needs) and, for MuSiQue, whose distractors often share a title with a supporting
paragraph, `supporting_passages` (the supporting passages' 1-based numbers). `context` is
LongBench's passage layout: "Passage 1:\\n<title>\\n<text>\\nPassage 2:\\n...", which the
harness splits back into one document per passage.

Run once by hand from a fetched snapshot (see eval/data/README.md); nothing in the build or the
tests runs it.

    python3 scripts/convert_multihop.py --input hotpot.json --dataset hotpotqa \\
        --sample 150 --seed 39 --rest --out eval/data/hotpotqa.jsonl
    python3 scripts/convert_multihop.py --input musique.json --dataset musique \\
        --sample 100 --seed 39 --rest --out eval/data/musique.jsonl
    python3 scripts/convert_multihop.py --input wikimqa_s_clean.json \\
        --dataset cacheblend_wikimqa --sample 70 --seed 39 --rest \\
        --out eval/data/cacheblend_wikimqa.jsonl
    python3 scripts/convert_multihop.py --input samsum.jsonl --dataset samsum_fewshot \\
        --sample 70 --seed 39 --rest --out samsum_fewshot.jsonl
"""

import argparse
import ast
import json
import random
import re
import sys

PASSAGE_HEADER = re.compile(r"^Passage \d+:$")


def read_records(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def as_list(value):
    """Some copies store nested lists as their Python repr; accept both."""
    if isinstance(value, str):
        return ast.literal_eval(value)
    return value


def paragraph_text(sentences):
    """HotpotQA keeps each sentence's leading space, 2WikiMultihopQA does not."""
    out = ""
    for s in sentences:
        if out and not s.startswith((" ", "\n")):
            out += " "
        out += s
    return out.strip()


def longbench_line(dataset, rid, question, passages, answers, supporting):
    """One output line: LongBench's fields over `passages` ((title, body) pairs)."""
    ctx = "\n".join(
        f"Passage {i}:\n{title}\n{body}" for i, (title, body) in enumerate(passages, 1)
    )
    return {
        "_id": f"{dataset}-{rid}",
        "input": question.strip(),
        "context": ctx,
        "answers": answers,
        "length": len(ctx.split()),
        "dataset": dataset,
        "language": "en",
        "all_classes": None,
        "supporting": supporting,
    }


def add_answers(answers, values):
    """Append each non-empty, new value, stripped, to `answers`."""
    for a in values:
        a = str(a).strip()
        if a and a not in answers:
            answers.append(a)
    return answers


def convert(rec, dataset):
    context = as_list(rec.get("context") or [])
    passages = []
    for title, sentences in context:
        body = paragraph_text(sentences)
        if not body:
            continue
        lines = [title.strip()] + body.splitlines()
        if any(PASSAGE_HEADER.match(line) for line in lines):
            raise ValueError(f"{rec['_id']}: a passage line looks like a passage header")
        passages.append((title.strip(), body))
    supporting = sorted({t for t, _ in as_list(rec.get("supporting_facts") or [])})
    line = longbench_line(
        dataset,
        rec["_id"],
        rec["question"],
        passages,
        [str(rec["answer"]).strip()],
        [t for t in supporting if any(t == p for p, _ in passages)],
    )
    return line, len(passages)


def convert_musique(rec, dataset):
    """MuSiQue: each paragraph a passage, the answer and its aliases as the answers."""
    passages, support = [], []
    for p in as_list(rec.get("paragraphs") or []):
        title, body = p["title"].strip(), p["paragraph_text"].strip()
        if not body:
            continue
        lines = [title] + body.splitlines()
        if any(PASSAGE_HEADER.match(line) for line in lines):
            raise ValueError(f"{rec['id']}: a passage line looks like a passage header")
        passages.append((title, body))
        if p.get("is_supporting"):
            support.append(len(passages))
    answers = add_answers([str(rec["answer"]).strip()], as_list(rec.get("answer_aliases") or []))
    supporting = sorted({passages[i - 1][0] for i in support})
    line = longbench_line(dataset, rec["id"], rec["question"], passages, answers, supporting)
    line["supporting_passages"] = support
    return line, len(passages)


def convert_cacheblend(rec, dataset, number):
    """CacheBlend's `inputs/*_s.json`: each ctx a passage, its title line empty where it has none."""
    passages = []
    for c in rec["ctxs"]:
        title, body = c.get("title", "").strip(), c["text"].strip()
        if not body:
            continue
        if any(PASSAGE_HEADER.match(line) for line in [title] + body.splitlines()):
            raise ValueError(f"record {number}: a passage line looks like a passage header")
        passages.append((title, body))
    answers = []
    for group in rec["answers"]:
        add_answers(answers, group if isinstance(group, list) else [group])
    return longbench_line(dataset, number, rec["question"], passages, answers, []), len(passages)


def samsum_dialogue(text):
    """A SAMSum dialogue with its line ends made "\\n" (the source mixes "\\r\\n" and "\\n")."""
    return "\n".join(line.strip() for line in text.replace("\r\n", "\n").split("\n") if line.strip())


def convert_samsum(records, dataset, examples, seed):
    """SAMSum as few-shot summaries: one line per `test` dialogue (see the module's doc)."""
    pool = [r for r in records if r.get("split") in ("train", "validation")]
    tests = [r for r in records if r.get("split") == "test"]
    if len(pool) < examples:
        sys.exit(f"{len(pool)} train and validation dialogues, fewer than --examples {examples}")
    rng = random.Random(seed)
    lines = []
    for number, rec in enumerate(tests, 1):
        shots = rng.sample(pool, examples)
        passages = [
            ("", f"Dialogue: {samsum_dialogue(r['question'])}\nSummary: {r['answer'].strip()}")
            for r in shots
        ]
        for _, body in passages:
            if any(PASSAGE_HEADER.match(line) for line in body.splitlines()):
                raise ValueError(f"test dialogue {number}: a line looks like a passage header")
        question = f"Dialogue: {samsum_dialogue(rec['question'])}"
        lines.append(longbench_line(dataset, number, question, passages, [rec["answer"].strip()], []))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True)
    ap.add_argument("--dataset", required=True, help="name written into each line")
    ap.add_argument("--sample", type=int, default=150)
    ap.add_argument("--seed", type=int, default=39)
    ap.add_argument("--min-passages", type=int, default=5)
    ap.add_argument(
        "--examples", type=int, default=10, help="SAMSum: few-shot examples (passages) per dialogue"
    )
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--rest",
        action="store_true",
        help="after the sample, append every other usable record (in the source's order): "
        "questions no choice was made on, so that later measurements can hold them out",
    )
    a = ap.parse_args()

    records = read_records(a.input)
    samsum = bool(records) and all("split" in r and "answer" in r for r in records)
    usable = convert_samsum(records, a.dataset, a.examples, a.seed) if samsum else []
    for number, rec in enumerate([] if samsum else records, 1):
        if "ctxs" in rec:
            line, n = convert_cacheblend(rec, a.dataset, number)
            if n >= a.min_passages and line["answers"]:
                usable.append(line)
            continue
        if not str(rec.get("answer", "")).strip() or rec.get("answerable") is False:
            continue
        if "paragraphs" in rec:
            line, n = convert_musique(rec, a.dataset)
        elif rec.get("context"):
            line, n = convert(rec, a.dataset)
        else:
            continue
        if n >= a.min_passages and line["supporting"]:
            usable.append(line)
    if len(usable) < a.sample:
        sys.exit(f"{a.input}: {len(usable)} usable records, fewer than --sample {a.sample}")
    # Seeded sample, written in the source's order.
    keep = sorted(random.Random(a.seed).sample(range(len(usable)), a.sample))
    with open(a.out, "w", encoding="utf-8") as f:
        for i in keep:
            f.write(json.dumps(usable[i], ensure_ascii=False) + "\n")
        rest = sorted(set(range(len(usable))) - set(keep)) if a.rest else []
        for i in rest:
            f.write(json.dumps(usable[i], ensure_ascii=False) + "\n")
    print(
        f"{a.out}: {a.sample} of {len(usable)} usable records (seed {a.seed})"
        + (f", then the other {len(rest)}" if a.rest else "")
    )


if __name__ == "__main__":
    main()
