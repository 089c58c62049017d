"""One module per Hugging Face ``model_type``: its trunk, key map and MTP head rule (the registry is ``models.MODEL_TYPES``)."""
