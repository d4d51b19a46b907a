"""A Django project with the database task backend (django-tasks-db), as a Django team runs
it: on Django 5.2 with the django-tasks backport, or on Django 6 with its own
``django.tasks`` (framework.py chooses). It does not import this project (the tasks that
record steps import the step ledger when they run)."""
