"""Verify stage: the search's best candidates re-measured end to end (:mod:`.end_to_end`), and what each rule of an
applied policy ran in (:mod:`.runcheck`).
"""
