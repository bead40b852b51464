"""One small module per recipe family. Each declares ``ModelConfig`` and ``DataConfig`` (the recipe's ``model`` and
``data`` sections) and ``build(cfg) -> Job``; optionally ``validate(cfg, problems)``. ``finetune.registry`` finds
them by file name; a task outside the package has the same shape and is named by its module or its file."""
