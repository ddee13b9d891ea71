"""Search stage: the search space (:mod:`.space`), its units from the module tree (:mod:`.structure`), the seed walk
(:mod:`.walks`) and the Optuna study that takes over from it (:mod:`.study`).
"""
