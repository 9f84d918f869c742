"""The embedded PyTorch inference engine: paged KV cache, continuous batching, a real model."""

from engine.config import LoadCancelled, ModelConfig, ModelError

__all__ = ["LLM", "SamplingParams", "ModelConfig", "ModelError", "LoadCancelled", "RequestOutput",
           "StepStats"]


def __getattr__(name: str):
    # Imported lazily so that `import engine` (e.g. for ModelError) does not pull in torch.
    if name in ("LLM", "StepStats"):
        from engine import llm

        return getattr(llm, name)
    if name in ("SamplingParams", "RequestOutput"):
        from engine import sequence

        return getattr(sequence, name)
    raise AttributeError(name)
