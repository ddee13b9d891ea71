"""What every layer of autoprec shares: standard JSON, how numbers and tables are written, the SQNR measure,
reading a number from /proc, and the names of a model that DDP, FSDP2 or torch.compile wrapped (:mod:`.wrapped`).
"""
