/**
 * Registers the jupyter-gpufrac frontend: the status bar item for the current
 * kernel's GPU lease, the details panel, and notifications when the GPU agent
 * moved, shrank or killed a kernel. Settings (schema/plugin.json) and the
 * translator are optional: without them it runs on the defaults, in English.
 */
import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { Session } from '@jupyterlab/services';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { ITranslator, nullTranslator } from '@jupyterlab/translation';

import { GpuFracModel } from './model';
import { InterventionNotifier } from './notify';
import { GpuFracPanel } from './panel';
import { ResumeQuestion } from './resume';
import { DEFAULT_SETTINGS, IGpuFracSettings, readSettings } from './settings';
import { GpuStatusItem } from './statusItem';
import { CurrentKernelTracker } from './tracker';
import { TRANSLATION_DOMAIN } from './trans';

const PLUGIN_ID = 'jupyter-gpufrac:plugin';

export namespace CommandIDs {
  export const openPanel = 'gpufrac:open-panel';
  export const toggleFullStatus = 'gpufrac:toggle-full-status';
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'GPU lease status, details and notifications for notebook kernels.',
  autoStart: true,
  optional: [IStatusBar, ICommandPalette, ISettingRegistry, ITranslator],
  activate: (
    app: JupyterFrontEnd,
    statusBar: IStatusBar | null,
    palette: ICommandPalette | null,
    settingRegistry: ISettingRegistry | null,
    translator: ITranslator | null
  ) => {
    const trans = (translator ?? nullTranslator).load(TRANSLATION_DOMAIN);
    const services = app.serviceManager;
    const model = new GpuFracModel({
      serverSettings: services.serverSettings,
      events: services.events,
      trans
    });
    // app.shell is the ILabShell in JupyterLab; its currentChanged drives it.
    const tracker = new CurrentKernelTracker(
      app.shell,
      model,
      widget => widget instanceof GpuFracPanel
    );

    // Running sessions name the notebooks behind kernel ids (other kernels'
    // notifications and the node's lease list).
    let sessions: Session.IModel[] = [];
    const updateSessions = () => {
      sessions = Array.from(services.sessions.running());
    };
    services.sessions.runningChanged.connect(updateSessions);
    updateSessions();
    const kernelName = (kernelId: string): string | null =>
      sessions.find(s => s.kernel?.id === kernelId)?.path ?? null;

    let panel: GpuFracPanel | null = null;
    const openPanel = async (kernelId?: string) => {
      if (kernelId && kernelId !== model.kernelId && !tracker.show(kernelId)) {
        // A notification about a notebook not open here: open it, and the
        // tracker follows it like any notebook brought to the front.
        const path = kernelName(kernelId);
        if (path) {
          await app.commands
            .execute('docmanager:open', { path })
            .catch(() => undefined);
        }
      }
      if (!panel || panel.isDisposed) {
        panel = new GpuFracPanel(model, kernelName);
        app.shell.add(panel, 'main', { mode: 'split-right' });
      }
      app.shell.activateById(panel.id);
    };

    app.commands.addCommand(CommandIDs.openPanel, {
      label: trans.__('Show GPU Lease Details'),
      caption: trans.__(
        'The GPU lease of the current kernel and the GPUs of this node'
      ),
      execute: args => openPanel(args.kernelId as string | undefined)
    });
    palette?.addItem({
      command: CommandIDs.openPanel,
      category: trans.__('GPU')
    });

    // Notifications name the notebook: the event's, else the followed
    // notebook's when it is that kernel, else the session's.
    const notebookOf = (kernelId: string): string | null =>
      (kernelId === model.kernelId && model.path) || kernelName(kernelId);
    const notifier = new InterventionNotifier(
      notebookOf,
      id => void openPanel(id),
      trans
    );
    model.eventReceived.connect((_, event) => notifier.handle(event));
    // c.GpuFrac.resume = "ask": restore a notebook's earlier state, or start fresh.
    const question = new ResumeQuestion(services.serverSettings, trans);
    model.eventReceived.connect((_, event) =>
      question.handleEvent(event, notebookOf(event.kernel_id))
    );
    model.changed.connect(() =>
      question.handleStatus(model.status, model.path || null)
    );
    // Cheap when nothing is new: the notifier remembers what it showed.
    model.changed.connect(() => notifier.configProblems(model.configProblems));

    const item = statusBar
      ? new GpuStatusItem(model, () => void openPanel())
      : null;
    if (statusBar && item) {
      statusBar.registerStatusItem(PLUGIN_ID, {
        item,
        align: 'left',
        rank: 100,
        isActive: () => tracker.hasKernelPanel,
        activeStateChanged: tracker.activeChanged
      });
    }

    // Settings apply live: the registry's `changed` fires on every save,
    // from the Settings editor or from the command below.
    let current: IGpuFracSettings = { ...DEFAULT_SETTINGS };
    let settings: ISettingRegistry.ISettings | null = null;
    const apply = () => {
      current = readSettings(settings?.composite as Record<string, unknown>);
      model.interval = current.refreshInterval;
      if (item) {
        item.mode = current.statusItem;
      }
      app.commands.notifyCommandChanged(CommandIDs.toggleFullStatus);
    };
    app.commands.addCommand(CommandIDs.toggleFullStatus, {
      label: trans.__('Show GPU Name and Limit in the Status Bar'),
      caption: trans.__(
        'Switch the GPU status item between the short line and the full one'
      ),
      isToggled: () => current.statusItem === 'full',
      isEnabled: () => settings !== null,
      execute: () =>
        settings?.set(
          'statusItem',
          current.statusItem === 'full' ? 'compact' : 'full'
        )
    });
    palette?.addItem({
      command: CommandIDs.toggleFullStatus,
      category: trans.__('GPU')
    });
    if (settingRegistry) {
      settingRegistry
        .load(PLUGIN_ID)
        .then(loaded => {
          settings = loaded;
          loaded.changed.connect(apply);
          apply();
        })
        .catch(reason => {
          // The defaults still work; an error would only alarm the console.
          console.warn(`${PLUGIN_ID}: settings not loaded`, reason);
        });
    }
  }
};

export default plugin;
