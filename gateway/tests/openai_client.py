"""The official `openai` Python client against a specrag server (run by openai_client.rs).

Usage: openai_client.py BASE_URL API_KEY. Prints one line per check; exits non-zero on the
first failure.
"""
import sys

import openai

base_url, key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)

models = [m.id for m in client.models.list()]
assert "specrag" in models, models
print("models:", models)

# A plain completion, with the RAG options through extra_body.
plain = client.chat.completions.create(
    model="specrag",
    messages=[{"role": "user", "content": "What does specrag store for each chunk?"}],
    max_tokens=8,
    extra_body={"specrag": {"top_k": 2, "method": "epic", "recompute_ratio": 0.15}},
)
choice = plain.choices[0]
assert choice.message.role == "assistant"
assert choice.finish_reason in ("stop", "length"), choice.finish_reason
assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
rag = plain.model_extra["specrag"]
assert len(rag["chunks"]) == 2 and rag["method"] == "epic", rag
print("plain:", repr(choice.message.content), plain.usage)

# Streamed: the pieces add up to the same answer; usage on the last chunk.
pieces, usage, finish = [], None, None
stream = client.chat.completions.create(
    model="specrag",
    messages=[{"role": "user", "content": "What does specrag store for each chunk?"}],
    max_tokens=8,
    stream=True,
    stream_options={"include_usage": True},
    extra_body={"specrag": {"top_k": 2, "method": "epic", "recompute_ratio": 0.15}},
)
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
assert "".join(pieces) == choice.message.content, (pieces, choice.message.content)
assert finish == choice.finish_reason and usage == plain.usage, (finish, usage)
print("streamed:", len(pieces), "pieces", usage)

# A conversation: earlier turns and a system message lengthen the prompt.
multi = client.chat.completions.create(
    model="specrag",
    messages=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is specrag?"},
        {"role": "assistant", "content": "A RAG serving gateway."},
        {"role": "user", "content": "What does specrag store for each chunk?"},
    ],
    max_tokens=4,
    extra_body={"specrag": {"top_k": 2, "method": "epic"}},
)
assert multi.usage.prompt_tokens > plain.usage.prompt_tokens, (multi.usage, plain.usage)
print("conversation:", multi.usage)

# A LangChain-style request: passages the application retrieved itself, sent twice, reordered
# with one replaced; the second reuses the stored KV of the shared ones.
passages = [
    {"id": f"p{i}", "text": f"Passage {i}: the keeper of lighthouse {i} counts {i * 7} ships."}
    for i in range(5)
]
def ask_with(docs):
    r = client.chat.completions.create(
        model="specrag",
        messages=[
            {"role": "system", "content": "Answer from the passages."},
            {"role": "user", "content": "How many ships does keeper 3 count?"},
        ],
        max_tokens=8,
        extra_body={"specrag": {"documents": docs}},
    )
    return r.model_extra["specrag"]
first = ask_with(passages)
assert first["reuse"]["chunks_recomputed"] == 5, first["reuse"]
again = list(reversed(passages[1:])) + [{"id": "new", "text": "An owl hunts mice in the barn."}]
second = ask_with(again)
reused = second["reuse"]["chunks_from_memory"] + second["reuse"]["chunks_from_disk"]
assert (reused, second["reuse"]["chunks_recomputed"]) == (4, 1), second["reuse"]
assert [c["doc_id"] for c in second["chunks"]] == [d["id"] for d in again], second["chunks"]
print("own passages:", second["reuse"])

# The same, as LangChain's "stuff" chain sends it: the retrieved passages joined by blank lines
# into the system message. specrag finds them there and reuses their KV by content.
def passage(i):
    return (
        f"The keeper of lighthouse {i} counts {i * 7} ships every night and writes each one into "
        "a ledger kept on the shelf by the lamp, beside the tide tables and the weather log of "
        "the harbour master, who reads it each morning before the boats leave the harbour."
    )
def ask_pasted(ids):
    context = "\n\n".join(passage(i) for i in ids)
    r = client.chat.completions.create(
        model="specrag",
        messages=[
            {"role": "system", "content": f"Answer from the context below.\n\n{context}"},
            {"role": "user", "content": "How many ships does keeper 3 count?"},
        ],
        max_tokens=8,
        extra_body={"specrag": {"collection": "own-retrieval"}},
    )
    return r.model_extra["specrag"]
first = ask_pasted([0, 1, 2, 3, 4])
assert [c["doc_id"] for c in first["chunks"]] == [f"messages[0]:{n}" for n in range(1, 6)], first
assert first["reuse"]["chunks_recomputed"] == 5, first["reuse"]
second = ask_pasted([4, 3, 9, 1, 0])
reused = second["reuse"]["chunks_from_memory"] + second["reuse"]["chunks_from_disk"]
assert (reused, second["reuse"]["chunks_recomputed"]) == (4, 1), second["reuse"]
print("pasted passages:", second["reuse"])

# A bad request raises the client's documented error type, naming the parameter.
try:
    client.chat.completions.create(
        model="specrag", messages=[{"role": "user", "content": "x"}], n=2
    )
    raise AssertionError("n=2 was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and e.body["param"] == "n", e.body
    print("bad request:", e.body["message"])
try:
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    raise AssertionError("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.body["code"] == "model_not_found", e.body
    print("unknown model:", e.body["message"])

# An invalid key.
try:
    openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    raise AssertionError("a wrong key was accepted")
except openai.AuthenticationError as e:
    assert e.status_code == 401
    print("wrong key: 401")
print("ok")
