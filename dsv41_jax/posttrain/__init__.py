"""Post-training: FP4-cache QAT and replay-aware fine-tuning (spec attention §7.6, §9.3-9.5).

``replay`` (the served forward as a differentiable training forward), ``sft`` (chat-template data), ``step``
(the loss), ``recipe`` (``dsv41 train`` with a ``posttrain:`` section), ``evaluate`` (``dsv41 eval-served``).
Submodules are imported where used: ``train.config`` reads only ``posttrain.config``.
"""
