// The periodic task form: only the inputs of the chosen schedule kind are shown.
//
// Each kind's inputs are a fieldset with the classes "driftsafe-kind driftsafe-kind-<kind>";
// the kind is the checked radio button "schedule_kind". Before a kind is chosen none is shown.
// Without JavaScript every fieldset stays visible and the server reads the chosen kind's only.
"use strict";
{
    const show = (form) => {
        const checked = form.querySelector('input[name="schedule_kind"]:checked');
        const kind = checked ? checked.value : "";
        for (const fieldset of form.querySelectorAll("fieldset.driftsafe-kind")) {
            fieldset.style.display = fieldset.classList.contains(`driftsafe-kind-${kind}`) ? "" : "none";
        }
    };
    window.addEventListener("DOMContentLoaded", () => {
        const first = document.querySelector('input[name="schedule_kind"]');
        if (!first) {
            return;  // read-only (a user who may only view): every kind's values stay shown
        }
        const form = first.form;
        show(form);
        form.addEventListener("change", (event) => {
            if (event.target.name === "schedule_kind") {
                show(form);
            }
        });
    });
}
