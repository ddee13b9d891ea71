"""``autoprec tune --for generation --served-mix``: weights and the KV cache planned for the workload served
(:mod:`autoprec.served_mix.run`), a path of its own beside the pipeline, as the streamed tune is."""
