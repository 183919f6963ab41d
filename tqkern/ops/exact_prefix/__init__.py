"""``replace_prefix``: an attention output over a compressed cache, corrected through its
log-sum-exp so that the first positions count with their exact K/V (attention sinks kept in 16
bits beside the cache). The NumPy oracle (:mod:`.reference`) is the spec; :mod:`.triton` is the
kernel the torch frontend (:func:`tqkern_torch.exact_prefix.replace_prefix`) launches."""
