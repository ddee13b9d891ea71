"""What autoprec knows about many processes (DDP, FSDP2, torchrun); the stages stay rank-agnostic.

:mod:`autoprec.distributed.models`: models that DDP, FSDP2 or torch.compile wrapped, as a policy names them.
"""
