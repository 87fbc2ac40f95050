"""What the process learns of each drafting model across calls: its measured drafting cost."""

from __future__ import annotations

from ..model_plan import plan_of, planned


class DraftingMemory:
    """What the process learnt of a drafting model (an assistant a policy priced) over its calls:
    its last measured drafting cost per token, as a share of the target's one-token forward at
    the batch and context it was measured at. A later call of the same assistant starts from it
    instead of the bytes prior (its own measurements then correct it), and does not try the
    assistant in a short block as if its drafts were of unknown worth. Kept in the model's plan
    (``specdec.model_plan``), forgotten with it."""

    @classmethod
    def share(cls, assistant) -> float | None:
        plan = planned(assistant) if assistant is not None else None
        return None if plan is None else plan.drafting_share

    @classmethod
    def learn(cls, assistant, share: float) -> None:
        if assistant is not None:
            plan_of(assistant).set("drafting_share", share)

