"""The accelerations of the reference model, chosen per device class by the plan (plan.py)."""
