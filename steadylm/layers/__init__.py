"""Small modules that load their own weights; models only compose them."""
