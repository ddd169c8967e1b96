from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_unique", "0003_uniquekey_run"),
    ]

    operations = [
        migrations.AddField(
            model_name="uniquekey",
            name="on_duplicate",
            field=models.CharField(
                blank=True,
                help_text="latest or debounce: the job's duplicates change it; empty: reuse.",
                max_length=8,
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="uniquekey",
            name="owed",
            field=models.TextField(
                blank=True,
                help_text="The job owed a run once this one ends (latest/debounce).",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="uniquekey",
            name="arguments",
            field=models.TextField(
                blank=True, help_text="The latest duplicate's arguments, encoded.", null=True
            ),
        ),
        migrations.AddField(
            model_name="uniquekey",
            name="due",
            field=models.BigIntegerField(
                blank=True, help_text="Debounce: the planned start, epoch milliseconds.", null=True
            ),
        ),
        migrations.AddField(
            model_name="uniquekey",
            name="cap",
            field=models.BigIntegerField(
                blank=True, help_text="Debounce: the latest planned start allowed.", null=True
            ),
        ),
    ]
