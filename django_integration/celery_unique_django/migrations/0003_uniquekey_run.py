from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_unique", "0002_uniquekey_since"),
    ]

    operations = [
        migrations.AddField(
            model_name="uniquekey",
            name="run",
            field=models.TextField(
                blank=True, help_text="The delivery of the job running now, if one is.", null=True
            ),
        ),
        migrations.AddField(
            model_name="uniquekey",
            name="handed_from",
            field=models.TextField(
                blank=True,
                help_text="The running job that handed the key over to this one.",
                null=True,
            ),
        ),
    ]
