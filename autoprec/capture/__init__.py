"""Capture stage: the table of every tunable layer (:mod:`.layers`) and how the model's ops are seen (:mod:`.tracing`).
"""
