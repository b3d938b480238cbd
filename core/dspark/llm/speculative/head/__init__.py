"""Feature-level draft heads (EAGLE-style): the head's model (``model``) and its drafter (``drafter``)."""
