"""specdec's speculative decoding as a Hub ``custom_generate`` repository.

``model.generate(**inputs, custom_generate="<this folder or its Hub name>", trust_remote_code=True,
draft="prompt_lookup")`` loads this file and calls :func:`generate` with everything ``generate()``
was given. It hands the call back to ``transformers``' own ``generate()`` with specdec's decoding
loop (``specdec.generate``), so the generation config, logits processors, stopping criteria and
streamer are prepared exactly as for a plain call, and every verified position is scored as
``generate()`` would score it. Keyword arguments: ``draft`` (a generator name, a draft model or a
``CandidateGenerator``), ``draft_options``, ``decoder_options``, ``target_tokenizer``,
``draft_tokenizer``, ``generator``, ``draft_call_options`` (see ``specdec.integration.generate``). ``stop_strings``
(the call's, else the generation config's) with ``tokenizer=`` become the criterion ``generate()``
builds from them, handed over as a stopping criterion: ``generate()`` does not give a callable loop
its ``tokenizer``.
"""

from transformers import GenerationMixin


def generate(model, *args, **kwargs):
    import specdec
    from transformers import StoppingCriteriaList, StopStringCriteria

    config = kwargs.get("generation_config") or model.generation_config
    # the call's stop strings, else the config's; handed over as a criterion (stop_strings=None below)
    stop_strings = kwargs.pop("stop_strings") if "stop_strings" in kwargs else config.stop_strings
    tokenizer = kwargs.pop("tokenizer", None)
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings need the model's tokenizer: pass tokenizer= to generate()")
        strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []),
                                                           StopStringCriteria(tokenizer, strings)])
    kwargs["stop_strings"] = None
    # GenerationMixin.generate, not model.generate: a model whose own repository ships a
    # custom_generate has model.generate replaced by it
    return GenerationMixin.generate(model, *args, custom_generate=specdec.generate, **kwargs)
