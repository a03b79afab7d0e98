"""The inbound product's part of the customer API: its views (``views.py``) and the
router ``deliveries.urls`` mounts at ``/api/v1/`` (``urls.py``)."""
