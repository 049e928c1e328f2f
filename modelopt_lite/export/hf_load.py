def load_hf_checkpoint(*a, **k):
    raise NotImplementedError
