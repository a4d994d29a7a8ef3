//! One contender's process: what it needs installed, starting it (again, if its first
//! start fails), and tearing its namespace down after a run.

use super::*;

impl Bench {
    /// Installs what a contender needs besides the Bench CRD (kro: its CRDs and the RGD).
    pub(crate) async fn prepare(&self, kind: Kind) -> Result<()> {
        if kind != Kind::Kro {
            return Ok(());
        }
        for entry in std::fs::read_dir(self.cfg.kro_dir.join("crds"))? {
            let text = std::fs::read_to_string(entry?.path())?;
            cluster::apply_yaml(&self.client, &text).await?;
        }
        cluster::wait_crd(
            &self.client,
            "resourcegraphdefinitions.kro.run",
            Duration::from_secs(60),
        )
        .await?;
        Ok(())
    }

    /// After kro starts: the RGD, and its generated CRD served.
    pub(crate) async fn after_start(&self, kind: Kind) -> Result<()> {
        if kind != Kind::Kro {
            return Ok(());
        }
        // An RGD left terminating by an interrupted run (its finalizer needs kro) goes
        // first; now that kro runs it can.
        let rgds = cluster::api(
            &self.client,
            None,
            "kro.run/v1alpha1",
            "ResourceGraphDefinition",
            "resourcegraphdefinitions",
        );
        let start = Instant::now();
        while let Some(o) = rgds.get_opt("benches.kro.bench.rulebook.dev").await? {
            if o.metadata.deletion_timestamp.is_none() {
                break;
            }
            if start.elapsed() > Duration::from_secs(120) {
                bail!("kro's old ResourceGraphDefinition is still terminating");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let text = std::fs::read_to_string(self.cfg.repo.join("benches/kro/rgd.yaml"))?;
        cluster::apply_yaml(&self.client, &text).await?;
        cluster::wait_crd(
            &self.client,
            "benches.kro.bench.rulebook.dev",
            Duration::from_secs(120),
        )
        .await?;
        let rgds = cluster::api(
            &self.client,
            None,
            "kro.run/v1alpha1",
            "ResourceGraphDefinition",
            "resourcegraphdefinitions",
        );
        let start = Instant::now();
        loop {
            let o = serde_json::to_value(rgds.get("benches.kro.bench.rulebook.dev").await?)?;
            if o.pointer("/status/state").and_then(Json::as_str) == Some("Active") {
                break;
            }
            if start.elapsed() > Duration::from_secs(120) {
                bail!(
                    "kro's ResourceGraphDefinition is not Active: {}",
                    o["status"]
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        // kro's instance controller starts when the RGD is active; give it its list.
        tokio::time::sleep(Duration::from_secs(2)).await;
        Ok(())
    }

    /// Removes a contender's parents while it still runs (kro's finalizers need kro),
    /// stops it, and deletes the namespace.
    pub(crate) async fn teardown(&self, mut p: Proc, kind: Kind, ns: &str, n: usize) -> Result<()> {
        if kind == Kind::Kro {
            let api = self.parent_api(kind, ns);
            let _ = api
                .delete_collection(&DeleteParams::background(), &ListParams::default())
                .await;
            let start = Instant::now();
            while api
                .list(&ListParams::default().limit(1))
                .await
                .map(|l| !l.items.is_empty())
                .unwrap_or(false)
            {
                if start.elapsed() > self.cfg.timeout_for(n) {
                    self.note_later(format!("kro: parents in {ns} not deleted in time"));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        if kind == Kind::Kro {
            // The RGD's finalizer needs kro: delete it while kro still runs.
            let rgds = cluster::api(
                &self.client,
                None,
                "kro.run/v1alpha1",
                "ResourceGraphDefinition",
                "resourcegraphdefinitions",
            );
            let _ = rgds
                .delete(
                    "benches.kro.bench.rulebook.dev",
                    &DeleteParams::background(),
                )
                .await;
            let start = Instant::now();
            while rgds
                .get_opt("benches.kro.bench.rulebook.dev")
                .await
                .ok()
                .flatten()
                .is_some()
                && start.elapsed() < Duration::from_secs(120)
            {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        p.stop();
        let secs = cluster::delete_namespace(&self.client, ns, Duration::from_secs(900)).await?;
        eprintln!("bench: namespace {ns} deleted in {secs:.1} s");
        Ok(())
    }

    /// `Rulebook (round 2)`, for the notes.
    pub(crate) fn who(&self, kind: Kind) -> String {
        format!("{} (round {})", kind.title(), self.round)
    }

    /// One run of a contender: the workloads in one process, then memory at each size in
    /// a fresh one. A failure is recorded in the run (`error`, `scale_errors`), not raised.
    pub(crate) async fn contender(&mut self, kind: Kind) -> Json {
        let mut r = json!({"title": kind.title(), "round": self.round, "seq": self.seq,
                           "loadavg_start": loadavg()});
        eprintln!(
            "bench: [{}] round {}, run {}",
            kind.name(),
            self.round,
            self.seq
        );
        if self.cfg.wants("converge") {
            match self.workloads(kind).await {
                Ok(w) => {
                    for (k, v) in w.as_object().into_iter().flatten() {
                        r[k] = v.clone();
                    }
                }
                Err(e) => {
                    eprintln!("bench: [{}] workloads failed: {e:#}", kind.name());
                    r["error"] = json!(format!("{e:#}"));
                }
            }
        }
        if self.cfg.wants("scale") {
            for m in self.cfg.scale_n.clone() {
                match self.scale(kind, m).await {
                    Ok(s) => r["scale"][m.to_string()] = s,
                    Err(e) => {
                        eprintln!("bench: [{}] memory at {m} failed: {e:#}", kind.name());
                        r["scale_errors"][m.to_string()] = json!(format!("{e:#}"));
                    }
                }
            }
        }
        r
    }

    pub(crate) fn note_later(&self, s: String) {
        eprintln!("bench: note: {s}");
    }

    pub(crate) fn launch<'a>(
        &'a self,
        kind: Kind,
        ns: &'a str,
        rules: &'a Path,
        templates: &'a Path,
        tag: &'a str,
    ) -> Launch<'a> {
        Launch {
            kind,
            binary: match kind {
                Kind::Rulebook => &self.cfg.rulebook_bin,
                Kind::Reference | Kind::ReferenceEvents => &self.cfg.reference_bin,
                Kind::Kro => &self.cfg.kro_bin,
            },
            kubeconfig: &self.cfg.kubeconfig,
            namespace: ns,
            concurrency: self.cfg.concurrency,
            rules,
            templates,
            log_dir: &self.log_dir,
            tag,
        }
    }

    /// Starts a contender and waits until it is ready; once more if the first process
    /// exited (its metrics port, picked free, may have been taken meanwhile by another
    /// test run on the machine).
    pub(crate) async fn start(
        &mut self,
        kind: Kind,
        ns: &str,
        rules: &Path,
        templates: &Path,
        tag: &str,
    ) -> Result<Proc> {
        let mut p = Proc::start(&self.launch(kind, ns, rules, templates, tag))?;
        match p.wait_ready(Duration::from_secs(120)).await {
            Ok(()) => Ok(p),
            // Dead, or alive with caches that never synced (the reference once sat 120 s
            // without its first listing): once more, with its own log.
            Err(e) => {
                self.notes.push(format!(
                    "{}: first start failed, started again: {e:#}",
                    self.who(kind)
                ));
                p.stop();
                let again = format!("{tag}-again");
                let mut p = Proc::start(&self.launch(kind, ns, rules, templates, &again))?;
                p.wait_ready(Duration::from_secs(120)).await?;
                Ok(p)
            }
        }
    }
}
