"""What travels: the fields of received messages checked once, strictly (``fields``)."""
