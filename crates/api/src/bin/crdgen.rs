//! Prints every stasis CRD as YAML (the chart's `crds/stasis.dev.yaml`).

fn main() {
    match stasis_api::crds_yaml() {
        Ok(yaml) => print!("{yaml}"),
        Err(e) => {
            eprintln!("crdgen: cannot render the CRDs as YAML: {e}");
            std::process::exit(1);
        }
    }
}
