"""lm-eval's ``local-completions`` with the server's choice of log-likelihood
estimator: the model ``refusion-completions``.

    python examples/lm_eval_recipe/refusion_lm.py --model refusion-completions \\
        --model_args base_url=http://127.0.0.1:8080/v1/completions,estimator=mc,mc_num=128,num_concurrent=4 \\
        --tasks ... --batch_size 4

The stock ``local-completions`` sends context + continuation as one prompt
and keeps the context's length to itself, so the server can only use its
default AR estimator. This subclass adds ``logprob_estimator``, ``mc_num``
and ``context_tokens`` (lm-eval's context lengths) to every loglikelihood
request, so ``estimator=mc`` scores each continuation with the authors'
masked-diffusion Monte Carlo estimator (docs/serving.md, "Scoring a
prompt"). Run as a script, it is lm-eval's command with this model registered.
"""

from __future__ import annotations

import sys

from lm_eval.api.registry import register_model
from lm_eval.models.openai_completions import LocalCompletionsAPI


@register_model("refusion-completions")
class RefusionCompletions(LocalCompletionsAPI):
    def __init__(self, estimator: str = "ar", mc_num: int = 128, **kwargs):
        super().__init__(**kwargs)
        if estimator not in ("ar", "mc"):
            raise ValueError(f"estimator must be ar or mc, got {estimator!r}")
        self.estimator, self.mc_num = estimator, int(mc_num)
        self._ctxlens = None  # the context lengths of the batch whose payload is made next

    def batch_loglikelihood_requests(self, chunks):
        inputs, ctxlens, cache_keys = super().batch_loglikelihood_requests(chunks)
        self._ctxlens = ctxlens  # one request at a time: the payload made next is this batch's
        return inputs, ctxlens, cache_keys

    async def amodel_call(self, session, sem, messages, *, ctxlens=None, **kwargs):
        self._ctxlens = ctxlens  # read by _create_payload before the call's first await
        return await super().amodel_call(session, sem, messages, ctxlens=ctxlens, **kwargs)

    def _create_payload(self, messages, generate=False, gen_kwargs=None, seed=1234, eos=None, **kwargs):
        payload = super()._create_payload(messages, generate=generate, gen_kwargs=gen_kwargs, seed=seed, eos=eos,
                                          **kwargs)
        if not generate and self.estimator == "mc":
            payload.update(logprob_estimator="mc", mc_num=self.mc_num, context_tokens=list(self._ctxlens))
        return payload


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    sys.exit(cli_evaluate())
