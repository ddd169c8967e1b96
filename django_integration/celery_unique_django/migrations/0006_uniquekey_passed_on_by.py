from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_unique", "0005_uniquekey_alive_until"),
    ]

    operations = [
        migrations.AddField(
            model_name="uniquekey",
            name="passed_on_by",
            field=models.TextField(
                blank=True,
                help_text="The ended job's delivery that passed the key on, until this one starts.",
                null=True,
            ),
        ),
    ]
