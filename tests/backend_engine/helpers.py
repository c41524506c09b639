"""Shared checks for engine tests."""


def assert_no_leaks(engine) -> None:
    """Every block is free (possibly still cached) once no request is in flight."""
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks)


def transformers_greedy(model: str, prompts: list[list[int]], new_tokens: int
                        ) -> list[tuple[list[int], list[float]]]:
    """transformers' own greedy tokens for each prompt (one at a time, fp32) and the logprob of
    each token."""
    import torch
    from transformers import AutoModelForCausalLM

    from backend_engine.model_loader import resolve_model

    hf = AutoModelForCausalLM.from_pretrained(resolve_model(model).folder,
                                              dtype=torch.float32).eval()
    answers = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(prompt):].tolist()
        answers.append((tokens, [torch.log_softmax(s[0].float(), -1)[t].item()
                                 for s, t in zip(out.scores, tokens)]))
    return answers


def assert_answers_close(fast, reference, tolerance: float) -> None:
    """Two paths give the same greedy tokens and logprobs within `tolerance`, except where the
    two tokens were a near-tie: at a sequence's first differing token, each path's token must
    be within `tolerance` of the other's in both paths' top logprobs (vLLM's
    check_logprobs_close, tightened); the sequences are compared no further after it."""
    for a, b in zip(fast, reference):
        for x, y in zip(a.logprobs, b.logprobs):
            if x.token_id == y.token_id:
                assert abs(x.logprob - y.logprob) < tolerance, (x, y)
                continue
            top_a, top_b = ({i: lp for i, _, lp in t.top} for t in (x, y))
            assert y.token_id in top_a and x.token_id in top_b, (x, y)
            assert x.logprob - top_a[y.token_id] < tolerance, (x, y)
            assert y.logprob - top_b[x.token_id] < tolerance, (x, y)
            break
