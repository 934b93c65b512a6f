"""Offline text for training without downloads: the corpora (`text_corpus`), their TFDS
builders (`tfds_offline`) and a tokenizer trained on them (`build_tokenizer`)."""
