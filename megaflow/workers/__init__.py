"""Worker roles that run inside worker groups (``megaflow.single_controller``)."""
