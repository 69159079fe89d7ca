"""The bundled demo model holds a conversation (retrained with refusion_mlx.train:
examples/demo_model/retrain.py); the golden tests keep the old weights."""

import refusion_mlx as rm
from refusion_mlx.serve.chat import ChatSession

QUESTIONS = ["Who is Sven?", "Spell the word cloud.", "What pet does Sven have?", "Reverse the words: river stone apple"]


def test_three_turns_answer_as_each_question_alone():
    model, tokenizer = rm.load(dtype="float32")
    params = rm.RefusionParams(gen_length=64, block_length=16)
    alone = [rm.generate(model, tokenizer, rm.chat_prompt(tokenizer, q), params=params) for q in QUESTIONS]
    assert alone[0].startswith("Sven lives in") and alone[1] == "c-l-o-u-d"
    session = ChatSession(model, tokenizer, params)
    together = [session.send(q) for q in QUESTIONS]
    assert together == alone
    assert session.turns[-1].reused_tokens > 0  # later turns continue the conversation's cache
