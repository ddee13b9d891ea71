"""Measuring a model under a policy, shared by every stage: paired timing (:mod:`.compare`), the metric and fidelity
(:mod:`.measure`, :mod:`.objective`), the budget, gradients in training, and one evaluated candidate.
"""
